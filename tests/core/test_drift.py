"""Drift statistics as llama.cpp reports them: KL (mean, p99, max), ΔNLL, RMS Δp, same top-1 on real text against
fp32 with the exact cache, the per-layer relative error of K and V, and why cached tokens left fp32's."""

import math

import pytest
import torch
import torch.nn.functional as F

from harness import measurements
from harness.core import measure
from harness.core.engines import KvlabEngine
from models.kv_cache import CACHE_KINDS
from tests.helpers.caches import CASES

TEXT = [torch.tensor([[464, 3290, 318, 257, 1332, 286, 262, 6801, 13, 198, 464, 2068, 7586, 21831, 18045, 625,
                       262, 16931, 3290, 13, 632, 373, 257, 3223, 290, 30367, 1755, 13, 383, 2344, 340, 19228,
                       11, 290, 262, 5417, 547, 3436, 13, 198, 464, 5252, 373, 1593, 290]])]


def spec(kind="prealloc", dtype=torch.float32, **options):
    return measure.CacheSpec(kind, options, dtype)


def test_the_exact_fp32_cache_against_itself_drifts_by_nothing(tiny_model):
    e = KvlabEngine(tiny_model)
    s, tables = measure.text_drift(e, e, spec("concat"), TEXT, T=8)
    layers = tables["layers"]
    assert s["drift_kl_max"] < 1e-9 and abs(s["drift_delta_nll"]) < 1e-6 and s["drift_same_top1"] == 1.0
    assert s["drift_text_positions"] == TEXT[0].shape[1] - 1
    assert (layers.k_rel_err < 1e-6).all() and (layers.v_rel_err < 1e-6).all()
    assert s["drift_first_layer_over_tol"] is None


def test_statistics_equal_their_definitions_on_the_pass_logits(tiny_model):
    """KL, ΔNLL and RMS Δp recomputed with torch's own functions from the logits of the two text passes."""
    e = KvlabEngine(tiny_model)
    lossy = spec("quant", k_bits=2, v_bits=2, group_size=8)
    s, _ = measure.text_drift(e, e, lossy, TEXT, T=8)
    ours, _ = measure.text_pass(e, lossy, TEXT[0], 8)
    ref, _ = measure.text_pass(e, spec("prealloc"), TEXT[0], TEXT[0].shape[1] - 1)  # the reference: one forward
    stepped, _ = measure.text_pass(e, spec("prealloc"), TEXT[0], 8)
    assert torch.allclose(ref, tiny_model(TEXT[0])[0, :-1], atol=1e-4)  # the fp32 pass is full attention
    assert torch.allclose(ref, stepped, atol=1e-4)  # and what decode steps through an exact cache compute
    target = TEXT[0][0, 1:]
    kl = F.kl_div(ours.double().log_softmax(-1), ref.double().log_softmax(-1), log_target=True,
                  reduction="none").sum(-1)
    dnll = F.cross_entropy(ours.double(), target) - F.cross_entropy(ref.double(), target)
    top = ref.argmax(-1)
    dp = ours.double().softmax(-1)[range(len(top)), top] - ref.double().softmax(-1)[range(len(top)), top]
    assert s["drift_kl"] == pytest.approx(kl.mean().item(), rel=1e-6)
    assert s["drift_kl_max"] == pytest.approx(kl.max().item(), rel=1e-6)
    assert kl.mean().item() <= s["drift_kl_p99"] <= kl.max().item() + 1e-12
    assert s["drift_delta_nll"] == pytest.approx(dnll.item(), rel=1e-6, abs=1e-12)
    assert s["drift_delta_ppl"] == pytest.approx(math.exp(s["text_nll"]) - math.exp(s["text_nll_fp32"]), rel=1e-6)
    assert s["drift_rms_dp"] == pytest.approx(dp.pow(2).mean().sqrt().item(), rel=1e-6)
    assert s["drift_same_top1"] == pytest.approx((ours.argmax(-1) == top).double().mean().item())
    assert s["drift_kl"] > 0


def test_every_scored_position_is_a_row_that_adds_up_to_the_summary(tiny_model):
    """text_positions holds each text's scored positions: its means are the run's figures, its ids pair the same
    text across runs and tell different texts apart, and its decoded rows are those after the prefill."""
    e = KvlabEngine(tiny_model)
    texts = [TEXT[0], TEXT[0][:, :30], TEXT[0]]
    lossy = spec("quant", k_bits=2, v_bits=2, group_size=8)
    s, tables = measure.text_drift(e, e, lossy, texts, T=8)
    rows = tables["text_positions"]
    assert list(rows.columns) == list(measurements.table("text_positions")["columns"])
    assert len(rows) == s["drift_text_positions"] == 2 * 44 + 29
    assert rows.groupby("text").position.max().tolist() == [43, 28, 43]
    assert rows.kl.mean() == pytest.approx(s["drift_kl"], rel=1e-9)
    assert rows.nll.mean() - rows.nll_fp32.mean() == pytest.approx(s["drift_delta_nll"], rel=1e-9, abs=1e-15)
    assert rows.same_top1.mean() == pytest.approx(s["drift_same_top1"])
    assert rows[rows.decoded == 1].kl.mean() == pytest.approx(s["drift_kl_decode"], rel=1e-9)
    assert (rows[rows.decoded == 0].position < 8).all() and (rows[rows.decoded == 1].position >= 8).all()  # T=8
    ids = rows.groupby("text").text_id.first().tolist()
    assert ids[0] == ids[2] != ids[1]  # the same tokens, the same id; other tokens, another
    again = measure.text_drift(e, e, spec("concat"), texts[:1], T=8)[1]["text_positions"]
    assert again.text_id.unique().tolist() == [ids[0]]


@pytest.mark.parametrize("dtype,unit", [(torch.float16, 2.0 ** -11), (torch.bfloat16, 2.0 ** -8)])
def test_layer_zero_kv_error_is_the_storage_rounding_alone(tiny_model, dtype, unit):
    """Layer 0's K and V come from the same embeddings in both passes: their relative error is the storage dtype's
    rounding, at most its unit roundoff; later layers add what the layers before them changed."""
    e = KvlabEngine(tiny_model)
    layers = measure.text_drift(e, e, spec("prealloc", dtype), TEXT, T=8)[1]["layers"]
    first = layers.set_index("layer").loc[0]
    assert 0 < first.k_rel_err <= unit and 0 < first.v_rel_err <= unit
    assert list(layers.layer) == list(range(tiny_model.config.n_layer))


def test_window_kv_is_compared_at_the_positions_it_holds(tiny_model):
    """A window cache keeps sinks + the latest W keys: in fp32 they are fp32's own at those positions (error 0 at
    layer 0), while its logits drift because attention sees fewer keys."""
    e = KvlabEngine(tiny_model)
    s, tables = measure.text_drift(e, e, spec("window", window=8, sinks=2), TEXT, T=4)
    layers = tables["layers"]
    assert layers.set_index("layer").loc[0, "k_rel_err"] < 1e-6
    assert s["drift_kl"] > 1e-6


def test_fewer_bits_drift_more(tiny_model):
    e = KvlabEngine(tiny_model)
    kl = {b: measure.text_drift(e, e, spec("quant", k_bits=b, v_bits=b, group_size=8), TEXT, T=8)[0]["drift_kl"]
          for b in (8, 4, 2)}
    assert kl[8] < kl[4] < kl[2]


def test_a_divergence_is_diagnosed_with_its_margin_and_first_layer(tiny_model):
    e = KvlabEngine(tiny_model)
    lossy = spec("quant", k_bits=2, v_bits=2, group_size=8)
    prompt, tokens = TEXT[0][:, :8], TEXT[0][0, 8:20].tolist()
    tie = measure.diagnose_divergence(e, e, lossy, prompt, tokens, step=6, margin=0.01, max_abs=1.0)
    assert tie["drift_near_tie"] and "near tie flipped by the lossy quant cache" in tie["drift_divergence_diagnosis"]
    assert tie["drift_divergence_layer"] == 0  # 2-bit K/V are off by far more than 1% from the first layer on
    bug = measure.diagnose_divergence(e, e, lossy, prompt, tokens, step=6, margin=10.0, max_abs=0.1)
    assert not bug["drift_near_tie"] and "bug" in bug["drift_divergence_diagnosis"]
    exact = measure.diagnose_divergence(e, e, spec("concat"), prompt, tokens, step=6, margin=0.01, max_abs=1.0)
    assert exact["drift_divergence_layer"] is None


def test_generation_checks_report_text_drift_and_layers(tiny_model):
    e = KvlabEngine(tiny_model)
    prompts = [TEXT[0][:, :8]]
    s, tables = measurements.run_on(e, spec("prealloc", torch.float16), prompts, 6, max_len=64, full_prompts=1,
                                    ref32=e, texts=TEXT)
    assert s["drift_kl"] > 0 and s["drift_text_positions"] == TEXT[0].shape[1] - 1
    assert list(tables["layers"].columns) == ["layer", "k_rel_err", "v_rel_err"]
    plain, tables = measurements.run_on(e, spec("prealloc"), prompts, 6, full_prompts=1)
    assert "drift_kl" not in plain and "layers" not in tables and "fp32 reference" in plain["text_drift_skipped"]


# ---- what the report says about them -------------------------------------------------------------------------

def _runs(**cols):
    import pandas as pd

    base = dict(run_name=["a", "b", "c", "d"], status="ok", model="mini", cache_label=["q k2/v2", "q k2/v8",
                "q k8/v2", "q k8/v8"], dtype="fp32", weights="pretrained", cache_k_bits=[2, 2, 8, 8],
                cache_v_bits=[2, 8, 2, 8], drift_kl=[0.3, 0.2, 0.1, 0.01], drift_delta_nll=[0.5, 0.3, 0.2, 0.02],
                weights_detail="checkpoint models/weights/mini")
    base.update(cols)
    return pd.DataFrame(base)


def test_the_report_builds_a_k_vs_v_table_from_bit_sweeps():
    from harness.analysis.report import drift_tables

    page = "".join(drift_tables(_runs()))
    assert "K vs V sensitivity, mini fp32: ΔNLL" in page and "K 2-bit" in page and "V 8-bit" in page
    assert page.index("q k8/v8") < page.index("q k2/v2")  # ranked by KL, smallest first
    assert drift_tables(_runs(drift_kl=None)) == []


def test_the_report_warns_loudly_when_a_sweep_mixes_real_and_random_weights():
    from harness.analysis.report import weights_notice

    mixed = "".join(weights_notice(_runs(weights=["random", "pretrained", "pretrained", "pretrained"])))
    assert "Warning: this sweep mixes pretrained weights (3 runs) and random-init weights (1 runs)" in mixed
    assert "Warning" not in "".join(weights_notice(_runs()))


# ---- on trained weights: the shipped mini model ranks as published results do ---------------------------------

@pytest.fixture(scope="module")
def mini_texts():
    from harness.core.inputs import text_prompts
    from models.gpt2 import GPT2
    from models.tokenizer import Tokenizer

    folder = measure.REPO / "models" / "weights" / "mini"
    model = GPT2.from_pretrained(folder).eval()
    return KvlabEngine(model), text_prompts(folder / "heldout.txt", 2, 128, Tokenizer())


@pytest.mark.slow  # a run or a trained model's drift: tens of seconds
def test_on_trained_weights_fp16_drifts_less_than_bf16_and_fewer_bits_more(mini_texts):
    e, texts = mini_texts
    kl = {name: measure.text_drift(e, e, s, texts, T=32)[0]["drift_kl"] for name, s in (
        ("fp16", spec("prealloc", torch.float16)), ("bf16", spec("prealloc", torch.bfloat16)),
        *((f"q{b}", spec("quant", k_bits=b, v_bits=b)) for b in (8, 4, 2)))}
    # (bf16 storage and an 8-bit cache are not ordered: on the shipped mini, 8-bit groups with fp16 scales drift
    # less than bf16's 8-bit mantissa; docs/drift.md)
    assert kl["fp16"] < kl["bf16"] and kl["fp16"] < kl["q8"] < kl["q4"] < kl["q2"], kl


@pytest.mark.slow
def test_trained_weights_drift_far_more_than_random_ones(mini_texts):
    """The reason the mini model exists: the same 2-bit cache moves a trained model's predictions much further."""
    from models.gpt2 import GPT2, GPT2Config

    e, texts = mini_texts
    torch.manual_seed(0)
    random = KvlabEngine(GPT2(GPT2Config.preset("mini")).eval())
    two = spec("quant", k_bits=2, v_bits=2)
    trained = measure.text_drift(e, e, two, texts, T=32)[0]
    untrained = measure.text_drift(random, random, two, texts, T=32)[0]
    assert trained["drift_kl"] > 10 * untrained["drift_kl"]
    assert trained["drift_rms_dp"] > 100 * untrained["drift_rms_dp"]
    assert trained["text_nll_fp32"] < 5.0 < untrained["text_nll_fp32"]


def test_statistics_do_not_depend_on_how_many_rows_are_held_at_once(tiny_model, monkeypatch):
    e = KvlabEngine(tiny_model)
    lossy = spec("quant", k_bits=2, v_bits=2, group_size=8)
    whole, _ = measure.text_drift(e, e, lossy, TEXT, T=8)
    monkeypatch.setattr(measure, "STAT_ROWS", 5)  # TEXT scores 44 positions: nine blocks
    blocks, _ = measure.text_drift(e, e, lossy, TEXT, T=8)
    for key, value in whole.items():
        if isinstance(value, float):
            assert blocks[key] == pytest.approx(value, rel=1e-9, abs=1e-15), key


@pytest.mark.parametrize("kind,opts", CASES)
def test_texts_passed_together_each_get_what_they_get_alone(tiny_model, kind, opts):
    """text_drift passes several texts of one length as the rows of one batched cache (``text_pass_rows``): every
    kind keeps its rows apart, so each row's logits are its text's passed alone (within float32 rounding), and so
    are the K/V it read."""
    e = KvlabEngine(tiny_model)
    g = torch.Generator().manual_seed(1)
    texts = [torch.randint(0, 50257, (1, 29), generator=g) for _ in range(3)]
    s = spec(kind, **opts)
    T = max(6, CACHE_KINDS[kind].min_prompt(CACHE_KINDS[kind].parse_options(**opts)))
    rows, seen = measure.text_pass_rows(e, s, torch.cat(texts), T)
    for b, text in enumerate(texts):
        alone, seen_alone = measure.text_pass(e, s, text, T)
        assert (rows[b] - alone).abs().max().item() <= 1e-4, f"text {b} of 3"
        for layer, (k, v, pos) in seen_alone.items():  # a quantiser's rounding may flip on float32's last bits
            at = seen[layer][2][b:b + 1] if pos is not None and pos.dim() == 3 else pos
            for got, want in ((held_rows(seen[layer][0][b:b + 1], at), held_rows(k, pos)),
                              (held_rows(seen[layer][1][b:b + 1], at), held_rows(v, pos))):
                assert got.shape == want.shape and (got - want).norm() <= 1e-3 * want.norm(), (layer, b)


def held_rows(x: torch.Tensor, pos: torch.Tensor | None) -> torch.Tensor:
    """What one sequence's attention read: ``x`` itself, or, for an evicting kind's per-head key positions (1, nh,
    n), each head's rows at the positions it held, in position order (a ragged layer pads each batch to its widest
    head, so the slots differ between a batch and a text alone; the keys held do not)."""
    if pos is None or pos.dim() != 3:
        return x
    rows = []
    for h in range(x.shape[1]):
        p = pos[0, h]
        rows.append(x[0, h][p >= 0][p[p >= 0].argsort()])
    return torch.cat(rows)


def test_a_fixed_pool_passes_one_text_at_a_time_and_any_other_kind_several(tiny_model):
    """A paged pool of cache.blocks blocks is sized (and checked) for one sequence: its texts go one by one, and
    the drift is what the unbounded pool's batched passes give."""
    assert spec("paged", block_size=4, blocks=8).rows_at_once() == 1
    assert spec("paged", block_size=4).rows_at_once() is None and spec("quant").rows_at_once() is None
    e = KvlabEngine(tiny_model)
    g = torch.Generator().manual_seed(3)
    texts = [torch.randint(0, 50257, (1, 25), generator=g) for _ in range(3)]
    fixed, _ = measure.text_drift(e, e, spec("paged", torch.float16, block_size=4, blocks=8), texts, T=6)
    grows, _ = measure.text_drift(e, e, spec("paged", torch.float16, block_size=4), texts, T=6)
    assert fixed["drift_kl"] > 0 and fixed["drift_kl"] == pytest.approx(grows["drift_kl"], rel=1e-3)


def test_text_drift_passes_texts_of_one_length_together_within_its_memory_bound(monkeypatch):
    texts = [torch.zeros(1, n, dtype=torch.long) for n in (10, 10, 10, 10, 7, 10)]
    monkeypatch.setattr(measure, "TEXT_ROWS_BYTES", 4 * 100 * 10 * 3)  # three texts of 10 tokens at vocab 100
    assert measure.text_batches(texts, vocab=100) == [[0, 1, 2], [3], [4], [5]]
    assert measure.text_batches(texts, vocab=100, most=2) == [[0, 1], [2, 3], [4], [5]]
    monkeypatch.setattr(measure, "TEXT_ROWS_BYTES", 1)  # less than one text's logits: still one at a time
    assert measure.text_batches(texts, vocab=100) == [[i] for i in range(6)]
