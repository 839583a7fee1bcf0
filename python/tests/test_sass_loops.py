"""tools/sass_loops.py (CPU only): the loops of a kernel in an nvdisasm listing."""

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("sass_loops", ROOT / "tools" / "sass_loops.py")
sass_loops = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sass_loops)

# Two kernels in nvdisasm -c's form (shortened): the first has a loop with an HGMMA in it and a
# forward branch; the second none.
LISTING = """\
\t.section\t.text._Z11main_kernelILi128EEvv,"ax",@progbits
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_1:
        /*0010*/                   HGMMA.64x64x16.F32.BF16 R56, gdesc[UR28], RZ, !UPT ;
        /*0020*/              @P0 BRA `(.L_x_2) ;
        /*0030*/                   IADD3 R2, R2, 0x1, RZ ;
.L_x_2:
        /*0040*/                   ISETP.GE.AND P1, PT, R2, 0x10, PT ;
        /*0050*/              @!P1 BRA `(.L_x_1) ;
        /*0060*/                   EXIT ;
\t.section\t.text._Z12delta_kernelILi128EEvv,"ax",@progbits
        /*0000*/                   EXIT ;
"""


def test_a_branch_back_is_a_loop_with_its_instruction_mix(tmp_path, capsys):
    listing = tmp_path / "x.sass"
    listing.write_text(LISTING)
    out = tmp_path / "picked.sass"
    assert sass_loops.main([str(listing), "main_kernel", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "7 instructions, HGMMA 1" in printed
    assert "loop 0x10-0x50: 5 instructions, HGMMA 1" in printed  # the forward branch is no loop
    assert "delta_kernel" not in printed and "delta_kernel" not in out.read_text()


def test_no_matching_kernel_is_an_error(tmp_path):
    listing = tmp_path / "x.sass"
    listing.write_text(LISTING)
    assert sass_loops.main([str(listing), "nope"]) == 1


# --order: a wait, two GEMMs folded into one line, an arrive, exponentials and a pack.
ORDER_LISTING = """\
\t.section\t.text._Z11main_kernelILi128EEvv,"ax",@progbits
        /*0000*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR16], RZ, !UPT ;
        /*0010*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR20], R24 ;
        /*0020*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;
        /*0030*/              @!P6 SYNCS.ARRIVE.TRANS64.A1T0 RZ, [UR8+0x30040], RZ ;
        /*0040*/                   FFMA R2, R2, R3, -R4 ;
        /*0050*/                   MUFU.EX2 R2, R2 ;
        /*0060*/                   MUFU.EX2 R5, R5 ;
        /*0070*/                   F2FP.BF16.F32.PACK_AB R152, R5, R2 ;
"""


def test_order_folds_runs_and_keeps_waits_arrives_and_exponentials(tmp_path, capsys):
    listing = tmp_path / "x.sass"
    listing.write_text(ORDER_LISTING)
    assert sass_loops.main([str(listing), "main_kernel", "--order"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1:] == [
        "0000 HGMMA.64x128x16.F32.BF16 R24, gdesc[UR16], RZ, !UPT",
        "    ... 1 more",
        "0020 WARPGROUP.DEPBAR.LE gsb0, 0x1",
        "0030 @!P6 SYNCS.ARRIVE.TRANS64.A1T0 RZ, [UR8+0x30040], RZ",
        "0050 MUFU.EX2 R2, R2",
        "    ... 1 more",
        "0070 F2FP.BF16.F32.PACK_AB R152, R5, R2",
    ]
