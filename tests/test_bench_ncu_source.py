"""bench/ncu_source.py: the per-instruction stall summary of an Nsight Compute source page (CSV)."""
from tests.bench_module import load_bench

HEADER = ",".join(f'"{c}"' for c in ("# Address", "Source", "Warp Stall Sampling (All Samples)",
                                      "Warp Stall Sampling (Not-issued Samples)", "Instructions Executed",
                                      "stall_long_sb", "stall_wait"))
CSV = '''==PROF== Connected to process 1
''' + HEADER + '''
"0x0010","LDG.E R1, [R2.64]","1,200","1,000","32768","900","10"
"0x0020","HMMA.16816.F32 R4, R8, R12, R4","300","200","65536","0","250"
"0x0030","EXIT","0","0","128","0","0"
'''


def test_summary_ranks_instructions_and_reasons(tmp_path, capsys):
    path = tmp_path / "src.csv"
    path.write_text(CSV)
    load_bench("ncu_source").summarise(str(path), top=2)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "3 SASS instructions, 1500 stall samples"        # thousands separators parsed, banner skipped
    assert out[1].split() == ["stall_long_sb", "60.0%"]                 # 900 of 1500, the largest reason first
    assert out[2].split() == ["stall_wait", "17.3%"]
    assert out[3].startswith("top 2 instructions")
    assert [ln.split()[0] for ln in out[4:]] == ["0x0010", "0x0020"]    # by samples, the top 2 only
    assert "stall_long_sb 900, stall_wait 10" in out[4]
