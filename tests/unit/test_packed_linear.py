"""Packed linears (specdec/packed_linear.py), MKL's per row count and oneDNN's for any: the same
products as F.linear, padding that changes no real row, the row counts each pass runs at, a model
whose multi-row passes (a verify round's) give the logits and greedy choices of its one-row
passes, and `auto` installing the faster of the two."""

from __future__ import annotations

import argparse

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from specdec import attention
from specdec.kv_cache import SequenceCache
from specdec.models import ModelConfig
from specdec.packed_linear import (
    ANY_ROWS,
    DEFAULT_PACKED_ROWS,
    ROW_BLOCK,
    OneDnnLinearForward,
    PackedLinearForward,
    calibration_order,
    check_row_counts,
    install_packed,
    linear_weight_bytes,
    native_bfloat16,
    onednn_available,
    pack_fastest,
    pack_linears,
    packing_available,
    packings_available,
    share_lone_row_checks,
    unpack_linears,
)
from specdec_cli.serve_cmd import packed_rows_flag
from tests.tiny_models import make_model

needs_mkl = pytest.mark.skipif(not packing_available("cpu", torch.float32),
                               reason="packed linears need a torch built with MKL")
needs_onednn = pytest.mark.skipif(not onednn_available("cpu", torch.float32),
                                  reason="oneDNN's packed linears need a torch built with oneDNN")


def _linear(in_features: int, out_features: int, bias: bool, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(in_features, out_features, bias=bias).eval()


def test_row_counts_are_checked_and_sorted():
    assert check_row_counts([17, 8, 8]) == (8, 17)
    with pytest.raises(ValueError, match=">= 4"):
        check_row_counts([3, 8])
    with pytest.raises(ValueError, match=">= 4"):
        ModelConfig("default", "target", packed_rows=(2,))


def test_the_flag_reads_auto_off_any_and_row_counts():
    assert packed_rows_flag("auto") == "auto"
    assert packed_rows_flag("off") == ()
    assert packed_rows_flag("any") == ANY_ROWS
    assert packed_rows_flag("16,8") == (8, 16)
    for bad in ("3", "eight", "", "any,8"):
        with pytest.raises(argparse.ArgumentTypeError):
            packed_rows_flag(bad)


def test_packing_runs_on_a_cpu_in_float32_and_in_native_bfloat16():
    assert ModelConfig("default", "target", dtype="float64").packing_candidates == ()
    assert ModelConfig("default", "target", dtype="float16").packing_candidates == ()
    # bfloat16: oneDNN's packing only (MKL's packed product is float32's), on a CPU that has it
    assert ModelConfig("default", "target", dtype="bfloat16").packing_candidates == (
        (ANY_ROWS,) if native_bfloat16() and onednn_available("cpu", torch.float32) else ())
    assert ModelConfig("default", "target", packed_rows=()).packing_candidates == ()
    available = packings_available("cpu", torch.float32)
    assert ModelConfig("default", "target", dtype="float32").packing_candidates == available
    assert ModelConfig("default", "target", dtype="float32", packed_rows=(6,)).packing_candidates == (
        ((6,),) if DEFAULT_PACKED_ROWS in available else ())
    assert ModelConfig("default", "target", packed_rows=ANY_ROWS).packing_candidates == (
        (ANY_ROWS,) if ANY_ROWS in available else ())


@needs_mkl
def test_each_pass_runs_at_the_next_packed_row_count():
    forward = PackedLinearForward(_linear(16, 24, bias=False), (8, 17))
    assert [forward.padded_rows(rows) for rows in (1, 2, 3)] == [None, None, None]  # matrix-vector path
    assert [forward.padded_rows(rows) for rows in (4, 5, 8)] == [8, 8, 8]
    assert [forward.padded_rows(rows) for rows in (9, 16, 17)] == [17, 17, 17]
    assert forward.padded_rows(18) is None  # beyond the largest packing: the plain product


@needs_mkl
@pytest.mark.parametrize("bias", [False, True])
def test_packed_products_equal_the_plain_ones(bias):
    linear = _linear(48, 80, bias)
    forward = PackedLinearForward(linear, (4, 8, 17))
    generator = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for rows in range(1, 22):
            x = torch.randn(1, rows, 48, generator=generator)  # (batch, rows, features) as in a model
            got, expected = forward(x), F.linear(x, linear.weight, linear.bias)
            assert got.shape == expected.shape == (1, rows, 80)
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@needs_mkl
def test_padding_changes_no_real_row():
    """A product of 5 rows padded with zeros to 8 gives, for those 5 rows, exactly what the same 5
    rows give among 3 other, random rows: rows do not mix."""
    linear = _linear(64, 96, bias=True)
    forward = PackedLinearForward(linear, (8,))
    generator = torch.Generator().manual_seed(2)
    rows = torch.randn(5, 64, generator=generator)
    others = torch.randn(3, 64, generator=generator)
    with torch.inference_mode():
        padded = forward(rows)
        full = forward(torch.cat((rows, others)))
    assert torch.equal(padded, full[:5])


@pytest.mark.parametrize("packing, fed_rows, kind", [
    pytest.param((4, 8), 7, PackedLinearForward, marks=needs_mkl, id="mkl: 7 rows padded to 8"),
    pytest.param(ANY_ROWS, 9, OneDnnLinearForward, marks=needs_onednn, id="onednn: 9 rows"),
])
def test_a_models_multi_row_pass_gives_its_one_row_passes_logits_and_choices(packing, fed_rows, kind):
    """What verification relies on: a pass over n draft tokens scores each position as feeding the
    tokens one by one would (up to float rounding), greedy choices included."""
    model = make_model(seed=5, hidden_size=64, intermediate_size=128).to(torch.float32)
    attention.use_ragged(model)
    plain_bytes = linear_weight_bytes(model)
    assert plain_bytes == sum(m.weight.numel() * 4 for m in model.modules() if isinstance(m, nn.Linear))
    packed = pack_linears(model, packing)
    assert len(packed) == sum(isinstance(m, nn.Linear) for m in model.modules())
    generator = torch.Generator().manual_seed(3)
    context = torch.randint(4, model.config.vocab_size, (20,), generator=generator).tolist()
    fed = torch.randint(4, model.config.vocab_size, (fed_rows,), generator=generator).tolist()
    with torch.inference_mode():
        cache = SequenceCache(model)
        cache.feed(context)
        one_by_one = torch.stack([cache.feed([token])[-1] for token in fed])
        cache.truncate(len(context))
        together = cache.feed(fed)
        cache.truncate(len(context))
        unpack_linears(model)
        plain = cache.feed(fed)
    torch.testing.assert_close(together, one_by_one, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(together, plain, rtol=1e-5, atol=1e-5)
    assert torch.equal(together.argmax(-1), one_by_one.argmax(-1))
    assert not any("forward" in m.__dict__ for m in model.modules() if isinstance(m, nn.Linear))
    install_packed(packed)
    assert all(isinstance(m.__dict__["forward"], kind)
               for m in model.modules() if isinstance(m, nn.Linear))


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
def test_onednn_products_equal_the_plain_ones_at_every_row_count(bias):
    linear = _linear(48, 80, bias)
    forward = OneDnnLinearForward(linear)
    generator = torch.Generator().manual_seed(4)
    with torch.inference_mode():
        for rows in range(1, 22):
            x = torch.randn(1, rows, 48, generator=generator)
            got, expected = forward(x), F.linear(x, linear.weight, linear.bias)
            assert got.shape == expected.shape == (1, rows, 80)
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        assert forward(torch.randn(0, 48)).shape == (0, 80)


@needs_onednn
def test_onednn_rows_do_not_depend_on_the_others():
    """A row's product among others of any count is its product alone, up to float rounding."""
    linear = _linear(96, 64, bias=True, seed=3)
    forward = OneDnnLinearForward(linear)
    generator = torch.Generator().manual_seed(5)
    row = torch.randn(1, 96, generator=generator)
    with torch.inference_mode():
        alone = forward(row)
        for others in (1, 3, 7, 16):
            among = forward(torch.cat((torch.randn(others, 96, generator=generator), row)))
            torch.testing.assert_close(among[-1:], alone, rtol=1e-6, atol=1e-6)



@pytest.mark.skipif(not (native_bfloat16() and onednn_available("cpu", torch.bfloat16)),
                    reason="bit-for-bit rows need a CPU with native bfloat16 and a torch built with oneDNN")
@pytest.mark.parametrize("in_features, out_features", [(576, 576), (576, 192), (576, 1536), (1536, 576)])
def test_bfloat16_rows_are_bit_for_bit_their_value_alone_at_every_row_count(in_features, out_features):
    """SmolLM2-135M's layer shapes in bfloat16: every row of a product of 1 to 2 * ROW_BLOCK + 1
    rows is exactly its product alone. oneDNN's one-row path rounds the 1536-deep product
    differently on some CPUs: there its layer must find that out and run a lone row as two."""
    torch.manual_seed(6)
    linear = nn.Linear(in_features, out_features, bias=False).to(torch.bfloat16).eval()
    forward = OneDnnLinearForward(linear)
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(2 * ROW_BLOCK + 1, in_features, generator=generator).to(torch.bfloat16)
    with torch.inference_mode():
        alone = torch.cat([forward(x[i:i + 1]) for i in range(x.shape[0])])
        for rows in (2, 3, 5, 8, 17, ROW_BLOCK, ROW_BLOCK + 1, 2 * ROW_BLOCK + 1):
            for start in {0, 3, x.shape[0] - rows}:
                assert torch.equal(forward(x[start:start + rows]), alone[start:start + rows]), (rows, start)


class _LoneRowRoundsOtherwise(OneDnnLinearForward):
    """oneDNN's product, except that a one-row product comes out a rounding step off, as the
    one-row path of some CPUs does for some shapes."""

    def _pointwise(self, rows: torch.Tensor) -> torch.Tensor:
        out = super()._pointwise(rows)
        return torch.nextafter(out, torch.full_like(out, float("inf"))) if rows.shape[0] == 1 else out


@pytest.mark.skipif(not onednn_available("cpu", torch.bfloat16), reason="needs oneDNN's bfloat16 products")
def test_a_layer_whose_one_row_path_rounds_otherwise_runs_a_lone_row_as_two():
    torch.manual_seed(8)
    linear = nn.Linear(64, 48, bias=True).to(torch.bfloat16).eval()
    forward = _LoneRowRoundsOtherwise(linear)
    assert forward.pad_lone_row
    x = torch.randn(5, 64).to(torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(forward(x[2:3]), forward(x)[2:3])
        assert not torch.equal(forward._pointwise(x[2:3]), forward(x)[2:3])  # the path it avoids
    assert not OneDnnLinearForward(nn.Linear(64, 48).eval()).pad_lone_row  # float32: no row blocks


@pytest.mark.skipif(not onednn_available("cpu", torch.bfloat16), reason="needs oneDNN's bfloat16 products")
def test_layers_of_one_shape_share_what_any_of_them_found():
    """The same kernels run every layer of a shape: one layer's finding pads them all."""
    torch.manual_seed(9)
    found = _LoneRowRoundsOtherwise(nn.Linear(64, 48, bias=False).to(torch.bfloat16))
    same_shape = OneDnnLinearForward(nn.Linear(64, 48, bias=False).to(torch.bfloat16))
    other_shape = OneDnnLinearForward(nn.Linear(48, 64, bias=False).to(torch.bfloat16))
    float32 = OneDnnLinearForward(nn.Linear(64, 48, bias=False))
    alone = {forward: forward.pad_lone_row for forward in (same_shape, other_shape)}
    share_lone_row_checks([found, same_shape, other_shape, float32])
    assert found.pad_lone_row and same_shape.pad_lone_row
    assert other_shape.pad_lone_row == alone[other_shape] and not float32.pad_lone_row


@pytest.mark.skipif(len(packings_available("cpu", torch.float32)) < 2,
                    reason="auto chooses only where both MKL and oneDNN are built in")
def test_auto_installs_the_faster_packing_and_only_it():
    model = make_model(seed=8, hidden_size=64, intermediate_size=128).to(torch.float32)
    chosen = pack_fastest(model, packings_available("cpu", torch.float32), repeats=1)
    assert chosen in (ANY_ROWS, DEFAULT_PACKED_ROWS)
    kind = OneDnnLinearForward if chosen == ANY_ROWS else PackedLinearForward
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert all(isinstance(m.__dict__["forward"], kind) for m in linears)
    unpack_linears(model)
    assert pack_fastest(model, ()) == ()
    assert not any("forward" in m.__dict__ for m in linears)
    assert pack_fastest(model, (ANY_ROWS,)) == ANY_ROWS  # one candidate: no timing, installed
    assert all(isinstance(m.__dict__["forward"], OneDnnLinearForward) for m in linears)


def test_calibration_interleaves_the_candidates_so_a_slow_spell_falls_on_all_alike():
    order = calibration_order(("a", "b", "c"), repeats=4)
    assert [repeat for repeat, _ in order] == [r for r in range(5) for _ in range(3)]
    timed = [candidate for repeat, candidate in order if repeat]
    assert timed == list("cba" "abc" "cba" "abc")
    # over each pair of timed repeats every candidate sits, on average, at the same place
    for first in (0, 6):
        pair = timed[first:first + 6]
        places = {c: sum(i for i, x in enumerate(pair) if x == c) for c in "abc"}
        assert len(set(places.values())) == 1


@pytest.mark.skipif(len(packings_available("cpu", torch.float32)) < 2,
                    reason="auto chooses only where both MKL and oneDNN are built in")
def test_auto_leaves_out_a_packing_that_fails_to_build(monkeypatch, caplog):
    def cannot_reorder(self, linear):
        raise RuntimeError("no reorder here")

    monkeypatch.setattr(OneDnnLinearForward, "__init__", cannot_reorder)
    model = make_model(seed=9, hidden_size=64, intermediate_size=128).to(torch.float32)
    with caplog.at_level("WARNING", logger="specdec.packed_linear"):
        chosen = pack_fastest(model, (ANY_ROWS, DEFAULT_PACKED_ROWS), repeats=1)
    assert chosen == DEFAULT_PACKED_ROWS
    assert "oneDNN's, for any row count failed (no reorder here)" in caplog.text
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert all(isinstance(m.__dict__["forward"], PackedLinearForward) for m in linears)


@pytest.mark.parametrize("packed_rows", [None, (), ANY_ROWS, (8, 17)])
def test_a_loaded_model_reports_its_packing(tmp_path, packed_rows):
    from specdec.models import load_model
    from tests import tiny_models

    config = ModelConfig(str(tiny_models.save(make_model(seed=2).to(torch.float32), tmp_path / "m",
                                              with_tokenizer=False)), "target", dtype="float32",
                         packed_rows=packed_rows)
    candidates = config.packing_candidates
    loaded = load_model(config)
    linears = [m for m in loaded.model.modules() if isinstance(m, nn.Linear)]
    if not candidates:
        assert loaded.linear_packing == ""
        assert not any("forward" in m.__dict__ for m in linears)
    elif isinstance(linears[0].__dict__["forward"], OneDnnLinearForward):
        assert loaded.linear_packing == ANY_ROWS
    else:
        assert loaded.linear_packing == ",".join(map(str, DEFAULT_PACKED_ROWS))
