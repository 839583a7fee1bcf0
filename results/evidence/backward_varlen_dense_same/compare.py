#!/usr/bin/env python3
"""Compares the kernels of one backward file compiled from two source trees (compile.sh).

    compare.py A_DIR B_DIR TU          e.g. compare.py main branch bwd_04_dq_per_cta
    compare.py --sections A_DIR B_DIR TU

For each kernel of A (main) it finds B's kernel of the same name, with the anonymous
namespace's hash and a `false` last template argument (kVarlen = false, mangled Lb0E) dropped,
and says whether
  * the PTX bodies are identical up to register numbering (renumbered by first use), branch
    labels, the inline-asm labels of mbarrier waits and the anonymous namespace's name;
  * the SASS is identical: the bytes of the cubin's .text.KERNEL section;
and prints ptxas' registers, spill stores and stack frame of both. Kernels only in B (the
varlen instantiations, Lb1E) are listed apart. --sections compares every per-kernel section of
the cubins (.text, .nv.info, .nv.constant0, .nv.shared, .rela.text), with the symbol index that
.nv.info's EIATTR_PARAM_CBANK starts with zeroed (it counts the file's kernels).
No disassembler is needed (cuobjdump/nvdisasm were not installed where this ran)."""
import re
import subprocess
import sys


def norm(name):
    m = re.search(r'(\d+)_GLOBAL__N_', name)  # the length-prefixed anonymous namespace
    if m:
        length, start = int(m.group(1)), m.start(1) + len(m.group(1))
        name = name[:m.start(1)] + 'ANON' + name[start + length:]
    return name


def canon(name):
    return norm(name).replace('Lb0E', '')


def ptx_entries(path):
    out = {}
    for m in re.finditer(r'^\.(?:visible )?\.?entry (\S+)\($(.*?)^\}$', open(path).read(), re.S | re.M):
        name, body = m.group(1), m.group(2)
        body = body.replace(name, 'KERNEL')
        body = re.sub(r'\$L__BB\d+_', '$L__BB_', body)
        body = re.sub(r'\$L__tmp\d+', '$L__tmp', body)
        body = re.sub(r'\d+_GLOBAL__N__[0-9a-f]+_\d+_\w+?_cu_[0-9a-f]{8}', 'ANON', body)
        body = re.sub(r'\b(WAIT)_?\d+\b', r'\1_N', body)
        body = '\n'.join(l for l in body.splitlines() if not l.strip().startswith('.reg '))
        seen = {}

        def renumber(m):
            key = (m.group(1), m.group(2))
            if key not in seen:
                seen[key] = '%%%s_%d' % (key[0], sum(1 for k in seen if k[0] == key[0]))
            return seen[key]

        out[name] = re.sub(r'%(rd|rs|r|fd|f|p|hh|h)(\d+)\b', renumber, body)
    return out


def sections(path, kinds=None):
    out = {}
    table = subprocess.run(['readelf', '-S', '-W', path], capture_output=True, text=True).stdout
    for line in table.splitlines():
        m = re.search(r'\]\s+(\.\S+?)\.(_Z\S+)\s+\S+\s+\S+\s+(\S+)\s+(\S+)', line)
        if not m or (kinds and m.group(1) not in kinds):
            continue
        kind, name, off, size = m.group(1), m.group(2), int(m.group(3), 16), int(m.group(4), 16)
        with open(path, 'rb') as f:
            f.seek(off)
            data = bytearray(f.read(size))
        if kind == '.nv.info':
            i = 0
            while i < len(data):
                fmt, attr = data[i], data[i + 1]
                if fmt == 0x04:
                    n = int.from_bytes(data[i + 2:i + 4], 'little')
                    if attr == 0x0a:
                        data[i + 4:i + 8] = bytes(4)
                    i += 4 + n
                else:
                    i += 4
        out[(kind, name)] = bytes(data)
    return out


def ptxas_info(path):
    info, cur = {}, None
    for line in open(path):
        m = re.search(r"Compiling entry function '(\S+)'", line)
        if m:
            cur = m.group(1)
            info[cur] = {}
            continue
        m = re.search(r'(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads', line)
        if cur and m:
            info[cur].update(stack=int(m.group(1)), spill_st=int(m.group(2)), spill_ld=int(m.group(3)))
        m = re.search(r'Used (\d+) registers', line)
        if cur and m:
            info[cur]['regs'] = int(m.group(1))
    return info


def short(name):
    d = subprocess.run(['c++filt', name], capture_output=True, text=True).stdout.strip()
    return re.sub(r'\(.*\)$', '', d.replace('hattn::(anonymous namespace)::', ''))


def main():
    args = sys.argv[1:]
    if args[0] == '--sections':
        a, b, tu = args[1:4]
        sa = {(k, canon(n)): v for (k, n), v in sections(f'{a}/{tu}.cubin').items()}
        sb = {(k, canon(n)): v for (k, n), v in sections(f'{b}/{tu}.cubin').items()}
        same = sum(1 for k in sa if sb.get(k) == sa[k])
        for k in sa:
            if sb.get(k) != sa[k]:
                print(f'  DIFFERS {k[0]} {short(k[1])}')
        print(f'{tu}: per-kernel sections identical: {same} of {len(sa)} ({", ".join(sorted({k[0] for k in sa}))})')
        return
    a, b, tu = args[:3]
    pa, pb = ptx_entries(f'{a}/{tu}.ptx'), ptx_entries(f'{b}/{tu}.ptx')
    ta = {n: v for (k, n), v in sections(f'{a}/{tu}.cubin', {'.text'}).items()}
    tb = {n: v for (k, n), v in sections(f'{b}/{tu}.cubin', {'.text'}).items()}
    ia, ib = ptxas_info(f'{a}/{tu}.ptxas.txt'), ptxas_info(f'{b}/{tu}.ptxas.txt')
    A, B = {canon(n): n for n in pa}, {canon(n): n for n in pb}
    print(f'== {tu}')
    for key in sorted(A):
        na, nb = A[key], B.get(key)
        if nb is None:
            print(f'  only in {a}: {short(na)}')
            continue
        la, lb = pa[na].splitlines(), pb[nb].splitlines()
        lines = sum(1 for x, y in zip(la, lb) if x != y) + abs(len(la) - len(lb))
        ra, rb = ia.get(na, {}), ib.get(nb, {})
        sa, sb = ta.get(na, b''), tb.get(nb, b'')
        print(f'  {short(nb):48s} PTX {"identical" if lines == 0 else "DIFFERS (%d lines)" % lines:20s} '
              f'SASS {"identical" if sa == sb and sa else "DIFFERS"} ({len(sa) // 16} vs {len(sb) // 16} instr) '
              f'regs {ra.get("regs")}/{rb.get("regs")} spill {ra.get("spill_st")}/{rb.get("spill_st")} '
              f'stack {ra.get("stack")}/{rb.get("stack")}')
    for key in sorted(set(B) - set(A)):
        nb = B[key]
        r = ib.get(nb, {})
        print(f'  only in {b}: {short(nb):40s} {len(tb.get(nb, b"")) // 16} instr, regs {r.get("regs")} '
              f'spill {r.get("spill_st")}/{r.get("spill_ld")} stack {r.get("stack")}')


if __name__ == '__main__':
    main()
