"""Linear layers with their weights packed once for the CPU's matrix product: MKL's packing per
row count, or oneDNN's for any (float32; bfloat16 on a CPU with native bfloat16 instructions,
oneDNN's only).

For a product of 4 or more rows, MKL's float32 GEMM copies the whole weight matrix into its own
blocked layout on every call; for 1-3 rows it reads the weights as they are (a matrix-vector
path). On a CPU a pass over a verify round's K + 1 rows, or over several sessions' rows, then pays
that copy for every linear layer of the model: on SmolLM2-135M with two cores ~10 ms of a
56-67 ms pass over 4-8 rows, and what makes a 4-row pass cost 1.5x a 1-row one.

Packing each weight once (MKL's packed GEMM, `torch.ops.mkl`) for a fixed row count M leaves only
the product. A packing serves exactly M rows, so a pass of n rows, MIN_PACKED_ROWS <= n <= the
largest M, is padded with zero rows to the smallest packed M >= n and the padding's output rows are
dropped; every other pass keeps the plain `F.linear`. Rows do not mix in a matrix product (each
output row is its own input row times the weights), so the padding changes nothing in the real
rows; the values differ from the plain product's only by float rounding, as MKL's matrix-vector
and matrix-matrix paths already differ from each other.

The cost is memory: each packed row count holds another copy of every linear layer's weights
(DEFAULT_PACKED_ROWS: two copies; SmolLM2-135M's 0.5 GB of weights: its service holds 2.1 GB at
start against about 1.0 GB without, MKL's packed layout being somewhat larger than the weights).

The other packing, ANY_ROWS, is oneDNN's (`torch.ops.mkldnn`): each weight reordered once into
oneDNN's blocked layout, which serves a product of any row count, so there is no padding and one
copy of the weights in all. Where MKL's small-row products are slow (seen on an AMD EPYC: a pass
over 2-17 rows of SmolLM2-135M cost 1.6-2.1x one row), oneDNN's packed product over 2-12 rows costs
about what one row does. Each output row's value does not depend on the others (up to float
rounding, which for some shapes differs with the row count, as MKL's paths do). `auto`
(pack_fastest) installs, per machine, the faster of the two on the model's own layer shapes at
load.

In bfloat16, oneDNN's packed product gives every row exactly the value it has in a product of 2 to
ROW_BLOCK rows, bit for bit, wherever it sits in the product (measured on every layer shape of
SmolLM2-135M, 1 and 2 threads; above 32 rows some shapes change their blocking and rows move by a
rounding step). A product of one row is another matter: on some CPUs oneDNN's kernel takes a path
of its own for a single row, and there the 1536-deep down projection rounds about one row in ten
differently (seen on an AMD EPYC, Zen 4; on another of the same family the paths agreed). So each
bfloat16 layer checks at packing time whether its one-row products equal the same rows' values in
a larger product (LONE_ROW_PROBE rows of a fixed random input); where they do not, it runs a lone
row as two (the row twice), and so do the other layers of its shape (share_lone_row_checks: they
run the same kernels, and their probes pooled miss nothing). Not every layer: where the paths
agree the one-row path is the faster one for some shapes (the model's 49,152-wide head), and
doubling every one-token step's rows cost 12 % of a step on that Zen 4 with two threads. A
bfloat16 packed forward thus multiplies in blocks of ROW_BLOCK rows, a lone row as its layer's
check says: a row's value then never depends on what else is in the pass, which together with the
row-by-row attention of verify rows (specdec.attention) makes a batched verify pass score every row
exactly as a one-token step would (docs/architecture.md, "Batch-invariant passes").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

MIN_PACKED_ROWS = 4  # below this MKL's matrix-vector path is faster than any packing
# A pass of 4-8 rows runs as 8 (a single session's K <= 7 round, up to 8 sessions' plain steps),
# 9-17 as 17 (a round at the largest K of the default 16).
DEFAULT_PACKED_ROWS = (8, 17)
ANY_ROWS = "any"  # oneDNN's packing: one copy that serves every row count
# The most rows a bfloat16 packed product takes at once: up to here every row's value is its
# value alone (see the module's docstring); longer products run in blocks of this many rows.
ROW_BLOCK = 32
# Rows of the fixed random input with which a bfloat16 layer checks its one-row path (a few ms a
# layer; 1-2 s of the default target's load on two cores).
LONE_ROW_PROBE = 64


def native_bfloat16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512-BF16 or AMX)."""
    return bool(getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)()
                or getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())


def packing_available(device: str, dtype: torch.dtype) -> bool:
    """Whether packed linears can run here: a CPU, float32 and a torch built with MKL."""
    return (device == "cpu" and dtype == torch.float32 and torch.backends.mkl.is_available()
            and hasattr(torch.ops.mkl, "_mkl_linear"))


def onednn_available(device: str, dtype: torch.dtype) -> bool:
    """Whether oneDNN's packed linears can run here: a CPU, a torch built with oneDNN, and float32
    or bfloat16 on a CPU that multiplies it natively."""
    dtype_runs = dtype == torch.float32 or (dtype == torch.bfloat16 and native_bfloat16())
    return (device == "cpu" and dtype_runs and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def check_row_counts(row_counts: Sequence[int]) -> tuple[int, ...]:
    """The row counts sorted, each checked to be >= MIN_PACKED_ROWS; no duplicates."""
    rows = tuple(sorted(set(row_counts)))
    too_small = [count for count in rows if count < MIN_PACKED_ROWS]
    if too_small:
        raise ValueError(f"packed row counts must be >= {MIN_PACKED_ROWS} (fewer rows take MKL's "
                         f"faster matrix-vector path), got {too_small}")
    return rows


class PackedLinearForward:
    """A replacement for one nn.Linear's forward: the packed product for 4..max(row_counts) rows
    (padded to the next packed count), F.linear otherwise."""

    def __init__(self, linear: nn.Linear, row_counts: Sequence[int]) -> None:
        self.row_counts = check_row_counts(row_counts)
        self.weight = linear.weight
        self.bias = linear.bias
        weight = linear.weight.detach()
        self.packed = {rows: torch.ops.mkl._mkl_reorder_linear_weight(weight, rows)
                       for rows in self.row_counts}

    def padded_rows(self, rows: int) -> int | None:
        """The packed row count a product of `rows` rows runs at; None: the plain product."""
        if rows < MIN_PACKED_ROWS:
            return None
        return next((count for count in self.row_counts if count >= rows), None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        features = x.shape[-1]
        rows = x.numel() // features if features else 0
        padded = self.padded_rows(rows)
        if padded is None:
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(rows, features)
        if padded > rows:
            flat = torch.cat((flat, flat.new_zeros(padded - rows, features)))
        out = torch.ops.mkl._mkl_linear(flat.contiguous(), self.packed[padded], self.weight, self.bias,
                                        padded)
        return out[:rows].reshape(*x.shape[:-1], out.shape[-1])


class OneDnnLinearForward:
    """A replacement for one nn.Linear's forward: oneDNN's product over its weights reordered once,
    for a product of any row count; in bfloat16 in blocks of at most ROW_BLOCK rows, and a lone
    row as two where its one-row path rounds otherwise, so that each row's value is the same
    whatever else is in the product."""

    def __init__(self, linear: nn.Linear) -> None:
        self.weight = linear.weight
        self.bias = linear.bias
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach().contiguous(), None)
        self.row_block = ROW_BLOCK if linear.weight.dtype == torch.bfloat16 else None
        # (in_features, out_features, bias, dtype): what decides the kernels oneDNN runs
        self.shape = (*reversed(linear.weight.shape), linear.bias is not None, linear.weight.dtype)
        # Whether a lone row runs as two: where this layer's one-row path rounds otherwise (and
        # where another layer of its shape found so: share_lone_row_checks).
        self.pad_lone_row = self.row_block is not None and not self._lone_rows_agree()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        features = x.shape[-1]
        rows = x.numel() // features if features else 0
        if rows == 0:
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(rows, features)
        if self.row_block is None or rows <= self.row_block:
            out = self._product(flat)
        else:
            out = torch.cat([self._product(flat[start:start + self.row_block])
                             for start in range(0, rows, self.row_block)])
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def _product(self, rows: torch.Tensor) -> torch.Tensor:
        if self.pad_lone_row and rows.shape[0] == 1:
            return self._pointwise(rows.expand(2, -1))[:1]
        return self._pointwise(rows)

    def _lone_rows_agree(self) -> bool:
        """Whether each row of a fixed random input gets the same bits from oneDNN's one-row
        product as from products of ROW_BLOCK rows (module docstring)."""
        generator = torch.Generator().manual_seed(0)
        probe = torch.randn(LONE_ROW_PROBE, self.weight.shape[1], generator=generator)
        probe = probe.to(dtype=self.weight.dtype, device=self.weight.device)  # (LONE_ROW_PROBE, in_features)
        with torch.inference_mode():
            blocks = torch.cat([self._pointwise(probe[start:start + ROW_BLOCK])
                                for start in range(0, LONE_ROW_PROBE, ROW_BLOCK)])
            return all(torch.equal(self._pointwise(probe[row:row + 1]), blocks[row:row + 1])
                       for row in range(LONE_ROW_PROBE))

    def _pointwise(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(rows.contiguous(), self.packed, self.bias, "none", [], "")

    @property
    def row_invariant(self) -> bool:
        """Whether every row's value is exactly its value alone, whatever else is in the product."""
        return self.row_block is not None


LinearForward = PackedLinearForward | OneDnnLinearForward
Packing = tuple[int, ...] | str  # MKL's row counts, ANY_ROWS (oneDNN's), or () for none


_PACKED_DTYPES = (torch.float32, torch.bfloat16)


def _packable_linears(model: nn.Module) -> list[nn.Linear]:
    """The nn.Linear layers of `model` whose weights are float32 or bfloat16: the ones packing
    serves (packings_available says which packing runs in which)."""
    return [m for m in model.modules() if isinstance(m, nn.Linear) and m.weight.dtype in _PACKED_DTYPES]


def _linear_forward(module: nn.Linear, packing: Packing) -> LinearForward:
    """One layer's packed forward for `packing` (not installed)."""
    if packing == ANY_ROWS:
        return OneDnnLinearForward(module)
    return PackedLinearForward(module, check_row_counts(packing))


def pack_linears(model: nn.Module, rows: Sequence[int] | str) -> dict[nn.Linear, LinearForward]:
    """Gives every float32 or bfloat16 nn.Linear of `model` a packed forward: MKL's for these row
    counts, or oneDNN's for any (rows == ANY_ROWS); returns them by layer (install_packed puts
    them back after unpack_linears). Call after the weights are final (loaded, on their device,
    in their dtype)."""
    packing = rows if rows == ANY_ROWS else check_row_counts(rows)
    forwards = {module: _linear_forward(module, packing) for module in _packable_linears(model)}
    share_lone_row_checks(forwards.values())
    install_packed(forwards)
    return forwards


def share_lone_row_checks(forwards: Iterable[LinearForward]) -> None:
    """Layers of one shape run the same kernels, so where any of them found that its one-row
    path rounds otherwise, all of them run a lone row as two: pooled over a model's layers of a
    shape (30 in the default target), the probes cannot miss a difference that one layer's 64
    rows might. A shape includes the dtype, so only bfloat16 layers (row blocks) are padded."""
    onednn = [forward for forward in forwards if isinstance(forward, OneDnnLinearForward)]
    padded = {forward.shape for forward in onednn if forward.pad_lone_row}
    for forward in onednn:
        if forward.shape in padded:
            forward.pad_lone_row = True


def install_packed(forwards: dict[nn.Linear, LinearForward]) -> None:
    for module, forward in forwards.items():
        module.forward = forward


def linear_weight_bytes(model: nn.Module) -> int:
    """Bytes of the packable nn.Linear weights of `model` (a tied weight once): what one packed row
    count adds."""
    weights = {id(m.weight): m.weight for m in _packable_linears(model)}
    return sum(w.numel() * w.element_size() for w in weights.values())


CALIBRATION_ROWS = (1, 2, 4, 8, 16)  # a decode step, verify rounds at K = 1, 3, 7, 15, batches


def packings_available(device: str, dtype: torch.dtype) -> tuple[Packing, ...]:
    """The packings that can run here, oneDNN's first."""
    found: list[Packing] = []
    if onednn_available(device, dtype):
        found.append(ANY_ROWS)
    if packing_available(device, dtype):
        found.append(DEFAULT_PACKED_ROWS)
    return tuple(found)


def calibration_order(candidates: Sequence[Packing], repeats: int) -> list[tuple[int, Packing]]:
    """(repeat, candidate) in the order pack_fastest times them: every repeat times every
    candidate, forwards and backwards by turns, so that a slow spell of the machine (another
    service loading on the same cores, a noisy neighbour) falls on every candidate alike instead
    of on whichever was timed first. Repeat 0 is the warm-up."""
    order = []
    for repeat in range(repeats + 1):
        turn = list(candidates) if repeat % 2 == 0 else list(reversed(candidates))
        order.extend((repeat, candidate) for candidate in turn)
    return order


def pack_fastest(model: nn.Module, candidates: Sequence[Packing], repeats: int = 3) -> Packing:
    """Installs whichever candidate packing multiplies fastest here and returns it (() for none).

    With two or more candidates every packable linear layer of `model` is timed in turn: the layer
    is packed for each candidate, each packing's product is timed at each of CALIBRATION_ROWS,
    candidates interleaved (calibration_order; the fastest of `repeats` after a warm-up), and the
    layer's packings are dropped again, so that no more than one layer's extra copies are held at
    a time. The least total over all layers is packed and kept. Which library is faster depends
    on the CPU (MKL's small-row products are slow on an AMD EPYC), so `auto` measures it at load,
    on the model's own shapes. A candidate that fails to pack is logged and left out."""
    if not candidates:
        return ()
    if len(candidates) > 1:
        totals: dict[Packing, float] = {candidate: 0.0 for candidate in candidates}
        generator = torch.Generator().manual_seed(0)
        inputs: dict[tuple[int, int], torch.Tensor] = {}
        with torch.inference_mode():
            for module in _packable_linears(model):
                forwards: dict[Packing, LinearForward] = {}
                for candidate in list(totals):
                    try:
                        forwards[candidate] = _linear_forward(module, candidate)
                    except RuntimeError as error:  # a library that cannot pack these weights here
                        log.warning("packed linears: %s failed (%s); not used",
                                    describe_packing(candidate), error)
                        del totals[candidate]
                fastest: dict[tuple[Packing, int], float] = {}
                for repeat, candidate in calibration_order(list(forwards), repeats):
                    for rows in CALIBRATION_ROWS:
                        x = inputs.get((rows, module.in_features))
                        if x is None:
                            x = inputs[rows, module.in_features] = torch.randn(
                                rows, module.in_features, generator=generator).to(module.weight.dtype)
                        started = time.perf_counter()
                        forwards[candidate](x)
                        seconds = time.perf_counter() - started
                        if repeat:
                            key = (candidate, rows)
                            fastest[key] = min(seconds, fastest.get(key, seconds))
                for (candidate, _rows), seconds in fastest.items():
                    totals[candidate] += seconds
                del forwards
        if not totals:
            return ()
        chosen = min(totals, key=totals.__getitem__)
        log.info("packed linears: %s, the faster here (every linear layer over %s rows: %s)",
                 describe_packing(chosen), ", ".join(map(str, CALIBRATION_ROWS)),
                 "; ".join(f"{describe_packing(c)} {1000 * t:.1f} ms" for c, t in totals.items()))
    else:
        chosen = candidates[0]
    pack_linears(model, chosen)
    return chosen


def packing_text(packing: Packing) -> str:
    """A packing as --packed-rows and Info's linear_packing write it: "any", "8,17", "" (none)."""
    return packing if packing == ANY_ROWS else ",".join(map(str, packing))


def describe_packing(packing: Packing) -> str:
    if packing == ANY_ROWS:
        return "oneDNN's, for any row count"
    if packing:
        return f"MKL's, for {packing_text(packing)} rows"
    return "none"


def rows_invariant(model: nn.Module) -> bool:
    """Whether every linear layer of `model` gives each row exactly its value alone, whatever else
    is in the product (bfloat16 with oneDNN's packing; see the module's docstring)."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    forwards = [m.__dict__.get("forward") for m in linears]
    return bool(linears) and all(isinstance(f, OneDnnLinearForward) and f.row_invariant for f in forwards)


def unpack_linears(model: nn.Module) -> None:
    """Every nn.Linear of `model` back to its class's forward (the plain product); the packings
    live on only where pack_linears' result is kept."""
    for module in model.modules():
        if isinstance(module, nn.Linear) and isinstance(module.__dict__.get("forward"),
                                                         (PackedLinearForward, OneDnnLinearForward)):
            del module.forward
