#!/usr/bin/env python3
"""Checks the guide's SVG figures for text that collides, without rendering them.

For every <text> a box is estimated from x, y, text-anchor, font-size and font-weight (inherited
from <g> parents and the root <svg>; a <tspan> may change size and weight), then it reports:
  - text that runs out of the <rect> its anchor lies in (the smallest such rect);
  - two texts whose boxes overlap;
  - a <line>, <polyline>, unfilled <path> or stroked <rect> outline that crosses a text's box
    (arrows through labels), unless an opaque <rect> drawn after the line covers the text;
  - text outside the figure (viewBox, else width and height).
Approximations: advance widths are DejaVu Sans's, the font that renders here (wider than Helvetica,
so the estimate is conservative), in classes; bold adds 0.065 em a character; a monospace family
is 0.6 em a character. A box runs from 0.76 em above the baseline to 0.24 em below; the anchor
tested against rects is raised to mid-height. A text may carry rotate() and translate(); one with
another transform is skipped, as is a <tspan> with its own x or y, and a path with commands other
than absolute M, L, H, V, C, Z (curves are sampled). <defs>, <marker>, <pattern> and a <g> with a
transform are ignored.
Usage: tools/check_figures.py [--list] [FIGURE.svg ...]   (default: docs/guide/img/*.svg)
Exit 1 when anything is reported.
"""
import math
import pathlib
import re
import sys
import xml.etree.ElementTree as ET

ROOT = pathlib.Path(__file__).resolve().parent.parent
FIGURES = ROOT / "docs" / "guide" / "img"

# DejaVu Sans advance widths in 1/1000 em (measured from DejaVuSans.ttf, rounded up to a class).
_CLASSES = {
    180: "ⱼ", 230: "′", 280: "'ijl", 300: "IJ", 320: " ,.·’", 340: "/:;\\|", 360: "f-",
    400: "()[]t!ᵀ¹²³⁴⁰₀₁", 410: "r", 460: '"', 500: "*_`–", 530: "sz?⁻", 550: "c",
    590: "LFkvxy", 615: "PTYoδae", 636: "hnuSbdgpq0123456789${}EΣ∘", 660: "Kα",
    700: "AVXZBRC", 750: "UNH", 790: "DG&OQ", 820: "w", 840: "#+<=>^~−×→←⇔≥≤≠∞", 870: "M",
    900: "①②③④⑤⑥", 950: "%", 975: "m", 990: "W", 1000: "@…—",
}
WIDTH = {ch: w for w, chars in _CLASSES.items() for ch in chars}
UNKNOWN_WIDTH = 840  # a character not in the table: as wide as the arrows and math signs
BOLD_EXTRA = 65  # bold DejaVu Sans is about this much wider a character
MONO_WIDTH = 602  # DejaVu Sans Mono
ASCENT, DESCENT = 0.76, 0.24  # of the font size
TOL = 1.0  # pixels two boxes may share, or a text's box pass a rect's top or bottom, before it counts
PAD = 2.0  # pixels a text keeps from the left and right sides of its rect
SKIP = {"defs", "marker", "pattern", "title", "desc", "clipPath", "mask", "symbol"}
INHERITED = ("font-size", "font-weight", "text-anchor", "font-family", "fill", "stroke")


def tag(el):
    return el.tag.rsplit("}", 1)[-1]


def num(value, default=0.0):
    m = re.match(r"\s*(-?[\d.]+(?:e-?\d+)?)", value or "")
    return float(m.group(1)) if m else default


def text_width(s, style):
    size = num(style.get("font-size"), 16.0)
    family = style.get("font-family", "").lower()
    if "mono" in family or "courier" in family:
        return len(s) * MONO_WIDTH * size / 1000
    bold = style.get("font-weight", "normal") in ("bold", "bolder", "600", "700", "800", "900")
    return sum(WIDTH.get(c, UNKNOWN_WIDTH) + (BOLD_EXTRA if bold else 0) for c in s) * size / 1000


def runs(el, style, preserve):
    """(string, style) pieces of a <text>, whitespace collapsed as SVG renders it."""
    out = []

    def add(s, st):
        if s:
            out.append([s.replace("\n", " ").replace("\t", " ") if preserve else re.sub(r"\s+", " ", s), st])

    add(el.text, style)
    for child in el:
        if tag(child) == "tspan":
            if child.get("x") is not None or child.get("y") is not None:
                return None  # a tspan placed on its own: not handled
            child_style = {**style, **{k: child.get(k) for k in INHERITED if child.get(k)}}
            for s, st in runs(child, child_style, preserve) or []:
                add(s, st)
        add(child.tail, style)
    if not preserve:  # collapse across pieces and trim the ends
        joined = ""
        for piece in out:
            piece[0] = re.sub(r" +", " ", piece[0])
            if joined.endswith(" ") and piece[0].startswith(" "):
                piece[0] = piece[0][1:]
            joined += piece[0]
        if out:
            out[0][0] = out[0][0].lstrip()
            out[-1][0] = out[-1][0].rstrip()
    return [(s, st) for s, st in out if s]


def transform_point(transform, x, y):
    """Applies rotate(a [cx cy]) and translate(tx [ty]) in order; None for anything else."""
    for name, args in reversed(re.findall(r"(\w+)\s*\(([^)]*)\)", transform or "")):
        v = [float(a) for a in re.split(r"[\s,]+", args.strip()) if a]
        if name == "translate":
            x, y = x + v[0], y + (v[1] if len(v) > 1 else 0.0)
        elif name == "rotate":
            a = math.radians(v[0])
            cx, cy = (v[1], v[2]) if len(v) == 3 else (0.0, 0.0)
            dx, dy = x - cx, y - cy
            x, y = cx + dx * math.cos(a) - dy * math.sin(a), cy + dx * math.sin(a) + dy * math.cos(a)
        else:
            return None
    return x, y


class Text:
    def __init__(self, el, style):
        self.ok = False
        pieces = runs(el, style, el.get("{http://www.w3.org/XML/1998/namespace}space") == "preserve")
        if not pieces:
            return
        self.string = "".join(s for s, _ in pieces)
        size = num(style.get("font-size"), 16.0)
        width = sum(text_width(s, st) for s, st in pieces)
        x, y = num(el.get("x")), num(el.get("y"))
        left = x - {"middle": width / 2, "end": width}.get(style.get("text-anchor"), 0.0)
        corners = [(left, y - ASCENT * size), (left + width, y + DESCENT * size)]
        corners += [(left, corners[1][1]), (left + width, corners[0][1])]
        points = [transform_point(el.get("transform"), px, py) for px, py in corners]
        anchor = transform_point(el.get("transform"), x, y - 0.35 * size)  # mid-height of the anchor
        if None in points or anchor is None:
            return
        xs, ys = [p[0] for p in points], [p[1] for p in points]
        self.box = (min(xs), min(ys), max(xs), max(ys))
        self.anchor = anchor
        self.ok = True

    def __repr__(self):
        return repr(self.string if len(self.string) <= 60 else self.string[:57] + "...")


def walk(el, style):
    """Yields (element, inherited style) for every drawn element."""
    for child in el:
        if tag(child) in SKIP or (tag(child) == "g" and child.get("transform")):
            continue
        child_style = {**style, **{k: child.get(k) for k in INHERITED if child.get(k)}}
        yield child, child_style
        if tag(child) == "g":
            yield from walk(child, child_style)


def path_points(d):
    """Polylines of a path of absolute M, L, H, V, C, Z commands (curves sampled); None if others."""
    tokens = re.findall(r"[A-Za-z]|-?[\d.]+(?:e-?\d+)?", d or "")
    if any(t.isalpha() and t not in "MLHVCZ" for t in tokens):
        return None
    lines, cur, start, cmd, i = [], None, None, None, 0
    vals = lambda n: [float(t) for t in tokens[i:i + n]]  # noqa: E731
    while i < len(tokens):
        if tokens[i].isalpha():
            cmd = tokens[i]
            i += 1
            if cmd == "Z" and cur is not None:
                lines[-1].append(start)
                cur = start
            continue
        if cmd == "M":
            cur = start = tuple(vals(2))
            lines.append([cur])
            cmd, i = "L", i + 2
        elif cmd == "L":
            cur = tuple(vals(2))
            i += 2
            lines[-1].append(cur)
        elif cmd in "HV":
            v = float(tokens[i])
            cur = (v, cur[1]) if cmd == "H" else (cur[0], v)
            i += 1
            lines[-1].append(cur)
        elif cmd == "C":
            (x1, y1, x2, y2, x3, y3), (x0, y0) = vals(6), cur
            for k in range(1, 17):
                t = k / 16
                a, b, c, e = (1 - t) ** 3, 3 * (1 - t) ** 2 * t, 3 * (1 - t) * t * t, t ** 3
                lines[-1].append((a * x0 + b * x1 + c * x2 + e * x3, a * y0 + b * y1 + c * y2 + e * y3))
            cur, i = (x3, y3), i + 6
        else:
            return None
    return lines


def segment_hits_box(p, q, box):
    """Whether segment pq passes through the box (Liang-Barsky clipping)."""
    (x0, y0), (x1, y1) = p, q
    dx, dy = x1 - x0, y1 - y0
    lo, hi = 0.0, 1.0
    for step, start, low, high in ((dx, x0, box[0], box[2]), (dy, y0, box[1], box[3])):
        if step == 0:
            if not low < start < high:
                return False
            continue
        t0, t1 = sorted(((low - start) / step, (high - start) / step))
        lo, hi = max(lo, t0), min(hi, t1)
        if lo >= hi:
            return False
    return True


def inside_of(box, outer):
    """Whether a text's box fits: PAD pixels clear of the sides, up to TOL over top and bottom."""
    return (box[0] >= outer[0] + PAD and box[2] <= outer[2] - PAD
            and box[1] >= outer[1] - TOL and box[3] <= outer[3] + TOL)


def shrink(box, by):
    return (box[0] + by, box[1] + by, box[2] - by, box[3] - by)


def check(path):
    """The problems of one figure, as strings."""
    root = ET.parse(path).getroot()
    style = {k: root.get(k) for k in INHERITED if root.get(k)}
    vb = [float(v) for v in re.split(r"[\s,]+", root.get("viewBox", "").strip()) if v]
    canvas = (vb[0], vb[1], vb[0] + vb[2], vb[1] + vb[3]) if len(vb) == 4 else \
        (0.0, 0.0, num(root.get("width")), num(root.get("height")))
    texts, rects, lines, covers = [], [], [], []
    for order, (el, st) in enumerate(walk(root, style)):
        kind = tag(el)
        if kind == "text":
            t = Text(el, st)
            if t.ok:
                texts.append(t)
        elif kind == "rect":
            x, y, w, h = (num(el.get(a)) for a in ("x", "y", "width", "height"))
            if w > 0 and h > 0 and (x, y, x + w, y + h) != canvas:
                rects.append((x, y, x + w, y + h))
                if st.get("fill", "black") != "none" and num(el.get("fill-opacity"), 1.0) >= 0.8:
                    covers.append((order, rects[-1]))
                if st.get("stroke", "none") != "none":  # its outline, as a line
                    lines.append((order, [(x, y), (x + w, y), (x + w, y + h), (x, y + h), (x, y)]))
        elif kind == "line":
            lines.append((order, [(num(el.get("x1")), num(el.get("y1"))), (num(el.get("x2")), num(el.get("y2")))]))
        elif kind == "polyline":
            v = [float(a) for a in re.split(r"[\s,]+", el.get("points", "").strip()) if a]
            lines.append((order, list(zip(v[0::2], v[1::2]))))
        elif kind == "path" and st.get("fill") == "none":
            lines.extend((order, points) for points in path_points(el.get("d")) or [])
    problems = []
    for t in texts:
        b = t.box
        if not inside_of(b, canvas):
            problems.append(f"outside the figure: {t}")
        inside = [r for r in rects if r[0] < t.anchor[0] < r[2] and r[1] < t.anchor[1] < r[3]]
        if inside:
            r = min(inside, key=lambda r: (r[2] - r[0]) * (r[3] - r[1]))
            if not inside_of(b, r):
                problems.append(f"runs out of its box {tuple(round(v) for v in r)}: {t}")
        for order, line in lines:
            if any(o > order and inside_of(b, r) for o, r in covers):
                continue  # an opaque rect drawn after the line hides it behind this text
            if any(segment_hits_box(p, q, shrink(b, TOL)) for p, q in zip(line, line[1:])):
                problems.append(f"a line crosses {t}")
                break
    for i, a in enumerate(texts):
        for b in texts[i + 1:]:
            if min(a.box[2], b.box[2]) - max(a.box[0], b.box[0]) > TOL and \
                    min(a.box[3], b.box[3]) - max(a.box[1], b.box[1]) > TOL:
                problems.append(f"texts overlap: {a} and {b}")
    return problems


def main(argv):
    listing = "--list" in argv
    paths = [pathlib.Path(a) for a in argv if a != "--list"] or sorted(FIGURES.glob("*.svg"))
    failed = 0
    for path in paths:
        problems = check(path)
        failed += bool(problems)
        for p in problems:
            print(f"{path}: {p}")
    if listing:
        print(f"{len(paths)} figures checked, {failed} with problems")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
