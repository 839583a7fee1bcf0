"""python -m hattn.capstone on its toy model: the harness on the CPU (every attention goes to
torch there), and on a Hopper GPU, where hattn runs the attention of a real diffusers model."""

import json

import pytest
import torch
from hattn import capstone
from helpers import requires_hopper

diffusers = pytest.importorskip("diffusers", reason="the capstone builds diffusers' Wan transformer; pip install diffusers")


def test_arguments_are_checked():
    with pytest.raises(SystemExit):
        capstone.parse_args(["--device", "cpu", "--model", "wan2.1-1.3b"])  # only the toy runs on the CPU
    with pytest.raises(SystemExit):
        capstone.parse_args(["--variants", "torch_default,nope"])
    with pytest.raises(SystemExit):
        capstone.parse_args(["--reps", "0"])


def test_token_counts_are_the_benchmark_capstone_shapes():
    assert capstone.tokens("480p") == 32760
    assert capstone.tokens("720p") == 75600


def test_tiny_model_on_the_cpu(tmp_path, capsys):
    rc = capstone.main(["--model", "tiny", "--size", "tiny", "--device", "cpu", "--reps", "2",
                        "--variants", "torch_default,hattn", "--out", str(tmp_path)])
    assert rc == 0
    result = json.loads((tmp_path / "capstone.json").read_text())
    rows = {r["variant"]: r for r in result["results"]}
    assert rows["hattn"]["max_abs_diff_vs_first"] == 0.0  # on the CPU hattn hands every call to torch
    calls = result["meta"]["attention_calls_per_hattn_pass"]
    assert calls["by_hattn"] == 0
    assert sum(calls["to_torch"].values()) == 2 * 2  # self- and cross-attention in each of 2 layers
    assert all("Hopper" in why for why in calls["to_torch"])
    assert (tmp_path / "capstone.csv").read_text().count("\n") == 3
    assert "one transformer forward" in capsys.readouterr().out


@requires_hopper
def test_tiny_model_on_the_gpu(tmp_path):
    assert capstone.main(["--model", "tiny", "--size", "tiny", "--reps", "2", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "capstone.json").read_text())
    calls = result["meta"]["attention_calls_per_hattn_pass"]
    assert calls["by_hattn"] == 4 and not calls["to_torch"], calls
    rows = {r["variant"]: r for r in result["results"]}
    scale = rows["torch_default"]["output_max_abs"]
    assert rows["hattn"]["max_abs_diff_vs_first"] <= 2e-2 * scale, rows["hattn"]
    assert rows["hattn"]["hattn_speedup"] == pytest.approx(1.0)
    if "fa3" in rows:  # FA3's library given (HATTN_FA3_LIB): it ran every call too, to the same output
        fa3_calls = result["meta"]["attention_calls_per_fa3_pass"]
        assert fa3_calls["by_fa3"] == 4 and not fa3_calls["to_torch"], fa3_calls
        assert rows["fa3"]["max_abs_diff_vs_first"] <= 2e-2 * scale, rows["fa3"]


def test_every_attention_of_the_model_fits_hattn(monkeypatch):
    """The model's own SDPA calls (bf16, [B, H, L, E] views) meet every rule but the device one,
    so on a Hopper GPU hattn runs all of them, self- and cross-attention alike."""
    import torch.nn.functional as F
    from hattn.sdpa import _torch_sdpa, sdpa_fallback_reason

    model, config = capstone.build_model("tiny", "cpu", torch.bfloat16, 0)
    latents, timestep, text = capstone.make_inputs("tiny", "tiny", config, "cpu", torch.bfloat16, 0)
    reasons = []

    def spy(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        reasons.append(sdpa_fallback_reason(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa,
                                            check_device=False))
        return _torch_sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                           scale=scale, enable_gqa=enable_gqa)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    with torch.inference_mode():
        model(latents, timestep, text, return_dict=False)
    assert reasons == [None] * 4, reasons


def test_fa3_variant_is_left_out_where_it_cannot_run(tmp_path, capsys):
    """Without FA3 (here: on the CPU) the fa3 variant is left out and the report says why."""
    rc = capstone.main(["--model", "tiny", "--size", "tiny", "--device", "cpu", "--reps", "1",
                        "--variants", "torch_default,fa3", "--out", str(tmp_path)])
    assert rc == 0
    result = json.loads((tmp_path / "capstone.json").read_text())
    assert [r["variant"] for r in result["results"]] == ["torch_default"]
    assert result["meta"]["fa3"] == "FlashAttention-3 runs on the GPU only"
    assert "fa3: FlashAttention-3 runs on the GPU only" in capsys.readouterr().out
