"""Entropy coding of small-alphabet indices: an exact count table and an interleaved static rANS coder.

Wire format of :func:`entropy_encode` (``n`` symbols; ``n`` itself is the caller's to store):

- ``n == 0``: no bytes at all.
- A table, as an Elias omega stream (:mod:`fedquant.wire.elias`, zero-padded to a byte):
  ``omega(k)`` with ``k`` the number of distinct symbols present, then for each present symbol,
  in increasing order, ``omega(gap)`` (1-based, the first gap is ``symbol + 1``) and
  ``omega(count)``. Absent symbols take no table space and get no probability mass.
- With ``k == 1`` nothing follows: the data is that one symbol repeated. With ``k >= 2``:
- two header bytes: bits 0-4 of the first hold ``P - 1``, the model precision ``P``; bit 5 names
  the coder (1: ``rans32``, 32-bit states and 16-bit words, ``P <= 12``; 0: ``rans64``, 64-bit
  states and 32-bit words, ``P <= 24``; ``2**P >= k``); bit 6 is reserved (0); bit 7 is set when
  the symbols come in several blocks. The second byte is ``log2`` of the lanes (rans32: 1 to 32
  coder states; rans64: 1 to 8);
- with several blocks: one byte ``b`` (blocks of ``2**b`` symbols, ``10 <= b <= 32``, the last
  one shorter; ``ceil(n / 2**b) >= 2`` blocks), then for each block but the last its length in
  words (uint32);
- the blocks' rANS words, little-endian uint16 (rans32) or uint32 (rans64), each block as
  :mod:`fedquant.wire.rans` lays it out (its lanes' final states, then the words in decoding
  order).

Both ends turn the integer counts into the same frequencies ``f`` (integers >= 1 summing to
``2**P``, :func:`quantize_counts`), so the format is fully specified by integer arithmetic.

Size: the rANS words stay within ``n * KL(counts || f)`` plus a lane's state per lane and block
of ``n * H``. The encoder picks the smallest precision from 12 (less for short streams) that
loses at most 0.02% of ``n * H`` to the rounded model; rans32 up to 12 bits (32 lanes from 2**18
bits of output, one below), rans64 above (8 lanes from 2**17 bits, one below); and blocks of at
least 2**16 symbols, long enough that their overhead stays below 0.05%.

Decoding checks the table (symbols below ``num_symbols``, counts summing to ``n``), the header
(precision, lanes, block count against ``n``), the block lengths against the section, rejects a
section too short for the information the table implies before decoding anything, and after
each block that every word was consumed and every lane returned to the coder's initial state.
Anything else raises :class:`~fedquant.errors.PayloadError`. Work and memory are bounded by
``n`` and the section's size: the decode table has at most ``max(2**12, 8 n)`` entries (larger
rans64 models are decoded through a table of buckets of slots).

The decoder no longer recounts the decoded symbols against the table (format version 2 did): a
corrupted stream breaks a lane's final state, the CRC-32 of the envelope catches transmission
errors, and a forger can write any valid stream anyway.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import numpy as np

from fedquant.errors import PayloadError
from fedquant.wire.elias import elias_omega_decode_prefix, elias_omega_encode

__all__ = [
    "MAX_PRECISION",
    "Layout",
    "choose_layout",
    "empirical_entropy_bits",
    "entropy_decode",
    "entropy_encode",
    "entropy_encode_runs",
    "quantize_counts",
    "symbol_counts",
]

MAX_SYMBOLS = 1 << 16
MAX_COUNT = 1 << 38  # counts * 2**24 must fit in int64
MAX_PRECISION = 24  # frequencies are integers summing to 2**P, P <= MAX_PRECISION
MIN_BLOCK_LOG2 = 10
MAX_BLOCK_LOG2 = 32  # a block's length in words fits a uint32
_MAX_CODEWORD_BITS = 76  # Elias omega codeword of 2**64 - 1
_MULTI_BLOCK = 0x80
_RANS32 = 0x20
_RESERVED = 0x40
MAX_PRECISION32 = 12  # rans32 models (fedquant.wire.rans.MAX_PRECISION32)
_CODERS = {"rans32": (16, 5), "rans64": (32, 3)}  # word bits, largest log2 of the lanes
_DIRECT_MIN = 1 << 12  # a direct decode table of up to max(this, 8 n) entries
_HISTOGRAM_PART = 1 << 20  # symbols per parallel piece of the histogram
_SCRATCH = threading.local()  # the encoder's word buffer, kept per thread (see _scratch_words)
_SCRATCH_MAX_BYTES = 1 << 30
_PROBLEMS = {
    1: "starts from an invalid coder state",
    2: "ends before the last symbol",
    3: "has data left after the last symbol",
    4: "does not return to the coder's initial state",
}


def quantize_counts(counts: np.ndarray, n: int, precision: int = MAX_PRECISION) -> np.ndarray:
    """Integer frequencies ``>= 1`` summing to ``2**precision``, about ``counts * 2**precision / n``.

    Floors first; slots left over go to the symbols furthest below their share (largest
    ``counts * 2**P - f * n``, ties to the lower index), and floors bumped up to 1 that overshoot
    are taken back from the largest frequencies first. Deterministic integer arithmetic, so
    encoder and decoder agree bit for bit. Requires ``1 <= len(counts) <= 2**precision``, every
    count ``>= 1`` and ``sum(counts) == n <= 2**38``.
    """
    from fedquant.wire import rans

    return rans.quantize_counts(np.ascontiguousarray(counts, np.int64), int(n), int(precision))


def _check_num_symbols(num_symbols: int) -> None:
    if not 1 <= num_symbols <= MAX_SYMBOLS:
        raise ValueError(f"num_symbols must be in 1..{MAX_SYMBOLS}, got {num_symbols}")


def _symbol_dtype(num_symbols: int) -> np.dtype:
    return np.dtype(np.uint8 if num_symbols <= 256 else np.uint16)


def _canonical(symbols: np.ndarray, num_symbols: int) -> tuple[np.ndarray, bool]:
    """``(uint8 or uint16 symbols, read-only)``, and whether their range has been checked.

    A canonical dtype passes without a pass over the data (the histogram or the encoder checks
    the range); other integer dtypes are checked here, before they are narrowed.
    """
    s = np.asarray(symbols).reshape(-1)
    if not np.issubdtype(s.dtype, np.integer):
        raise ValueError(f"symbols must be integers, got dtype {s.dtype}")
    dtype = _symbol_dtype(num_symbols)
    checked = False
    if s.dtype != dtype:
        if s.size and (int(s.min()) < 0 or int(s.max()) >= num_symbols):
            raise ValueError(f"symbols must lie in 0..{num_symbols - 1}, got {int(s.min())}..{int(s.max())}")
        s = s.astype(dtype)
        checked = True
    s = np.ascontiguousarray(s).view()
    s.flags.writeable = False  # one kernel signature whatever the caller's array
    return s, checked


def _counts_of(symbols: np.ndarray, num_symbols: int) -> np.ndarray:
    """The histogram of canonical ``symbols`` over ``num_symbols`` bins, in one parallel pass.

    ValueError for symbols beyond the alphabet. The tables are sized by the alphabet, so a
    short stream of a large alphabet's dtype (uint16) costs no 65536-bin table.
    """
    from fedquant.wire import rans

    parts = max(1, min(64 if symbols.itemsize == 1 else 8, symbols.size // _HISTOGRAM_PART))
    counts = rans.histogram(symbols, parts, num_symbols)
    if counts[num_symbols]:
        raise ValueError(f"symbols must lie in 0..{num_symbols - 1}, got {int(symbols.min())}..{int(symbols.max())}")
    return counts[:num_symbols]


def symbol_counts(symbols, num_symbols: int) -> np.ndarray:
    """How often each of ``0 .. num_symbols - 1`` occurs in ``symbols`` (int64, ``num_symbols`` entries).

    What :func:`entropy_encode` takes as ``counts=``. NumPy arrays (and CPU tensors) are counted
    by one parallel numba pass; a CUDA tensor is counted on its device (``torch.bincount``), so
    only the symbols travel to the host for coding.

    Parameters
    ----------
    symbols : np.ndarray or torch.Tensor
        Integers in ``0 .. num_symbols - 1``, any shape.
    num_symbols : int
        Alphabet size, 1 to 65536.
    """
    _check_num_symbols(num_symbols)
    if _is_device_tensor(symbols):
        return _device_counts(_checked_on_device(symbols, num_symbols), num_symbols)
    if _is_tensor(symbols):
        symbols = symbols.numpy()
    canon, _ = _canonical(symbols, num_symbols)
    return _counts_of(canon, num_symbols)


def _is_tensor(x) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "device")


def _is_device_tensor(x) -> bool:
    return _is_tensor(x) and x.device.type != "cpu"


def _checked_on_device(symbols, num_symbols: int):
    """A device tensor's symbols, flat, their dtype and range checked where they are."""
    flat = symbols.reshape(-1)
    if flat.is_floating_point() or flat.is_complex():
        raise ValueError(f"symbols must be integers, got dtype {flat.dtype}")
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= num_symbols):
        raise ValueError(f"symbols must lie in 0..{num_symbols - 1}, got {int(flat.min())}..{int(flat.max())}")
    return flat


def _device_counts(flat, num_symbols: int) -> np.ndarray:
    import torch

    return flat.to(torch.int64).bincount(minlength=num_symbols).cpu().numpy()


def _to_host(flat, num_symbols: int) -> np.ndarray:
    """Checked device symbols as a host array: uint8 for alphabets up to 256 (what travels), else int32."""
    import torch

    return flat.to(torch.uint8 if num_symbols <= 256 else torch.int32).cpu().numpy()


def _information_bits(counts: np.ndarray) -> float:
    """``n * H`` of a histogram (entries > 0), in bits."""
    c = counts.astype(np.float64)
    n = c.sum()
    return float(n * math.log2(n) - (c * np.log2(c)).sum()) if n else 0.0


def empirical_entropy_bits(symbols, num_symbols: int) -> float:
    """``n * H(p)`` in bits, where ``p`` is the empirical distribution of ``symbols``.

    Parameters
    ----------
    symbols : np.ndarray or torch.Tensor
        Integers in ``0 .. num_symbols - 1``.
    num_symbols : int
        Alphabet size.
    """
    counts = symbol_counts(symbols, num_symbols)
    return max(0.0, _information_bits(counts[counts > 0]))


@dataclass(frozen=True)
class Layout:
    """How a stream of symbols is coded: model precision, lanes, blocks, coder (a wire choice of the encoder).

    ``block_log2 = None`` codes all symbols as one block. ``coder``: ``"rans32"`` (32-bit states,
    16-bit words, precision at most 12, 1 to 32 lanes) or ``"rans64"`` (64-bit states, 32-bit
    words, precision at most 24, 1 to 8 lanes).
    """

    precision: int
    lanes: int
    block_log2: int | None = None
    coder: str = "rans32"


def choose_layout(counts: np.ndarray, n: int) -> tuple[Layout, np.ndarray]:
    """The encoder's layout for symbols of these ``counts`` (present ones, ``>= 2`` of them), and its frequencies.

    Precision: the smallest ``P`` from ``max(ceil(log2 k), min(12, bitlen(n) + 1))`` up to 16
    whose rounded model costs at most ``0.02% n H + 16`` bits more than ``n H``; else 16 if it is
    within 0.1%, else 24 (decoded through buckets, slower). Coder: ``rans32`` up to precision 12
    (32 lanes from ``2**18`` coded bits, the 31 extra final states then costing under 0.4%, else
    1), ``rans64`` above (8 lanes from ``2**17`` coded bits, else 1). Blocks: at least ``2**16``
    symbols, and enough of them that each block's states and length (``32 lanes + 32`` bits, or
    ``64 lanes + 32``) cost under 0.05% of its bits.
    """
    from fedquant.wire import rans

    counts = np.ascontiguousarray(counts, np.int64)
    k = counts.size
    info = _information_bits(counts)
    first = max((k - 1).bit_length(), min(12, n.bit_length() + 1), 1)
    for precision in range(first, 17):
        freq = rans.quantize_counts(counts, n, precision)
        cost = rans.model_bits(counts, freq, precision)
        if cost - info <= 2e-4 * info + 16:
            break
    else:
        if cost - info > 1e-3 * info + 16:
            precision = MAX_PRECISION
            freq = rans.quantize_counts(counts, n, precision)
            cost = rans.model_bits(counts, freq, precision)
    if precision <= MAX_PRECISION32:
        coder, lanes, state_bits = "rans32", 32 if cost >= 1 << 18 else 1, 32
    else:
        coder, lanes, state_bits = "rans64", 8 if cost >= 1 << 17 else 1, 64
    overhead = state_bits * lanes + 32
    per_symbol = max(cost / n, 1e-12)
    block_log2 = max(16, math.ceil(math.log2(2000 * overhead / per_symbol)))
    block_log2 = min(block_log2, MAX_BLOCK_LOG2)
    return Layout(precision, lanes, block_log2 if n > 1 << block_log2 else None, coder), freq


def _table_bytes(present: np.ndarray, counts: np.ndarray) -> np.ndarray:
    gaps = np.diff(present, prepend=-1)
    table = np.empty(1 + 2 * present.size, np.int64)
    table[0] = present.size
    table[1::2] = gaps
    table[2::2] = counts
    header, _ = elias_omega_encode(table)
    return header


def _validated_counts(counts, n: int, num_symbols: int) -> np.ndarray:
    if _is_tensor(counts):
        counts = counts.cpu().numpy()
    c = np.asarray(counts)
    if c.shape != (num_symbols,) or not np.issubdtype(c.dtype, np.integer):
        raise ValueError(f"counts must be {num_symbols} integers, got shape {c.shape} of dtype {c.dtype}")
    c = c.astype(np.int64)
    if c.size and int(c.min()) < 0:
        raise ValueError("counts must not be negative")
    if int(c.sum()) != n:
        raise ValueError(f"counts sum to {int(c.sum())}, but there are {n} symbols")
    return c


def entropy_encode(symbols, num_symbols: int, *, counts=None) -> np.ndarray:
    """Entropy-code ``symbols`` with their own empirical distribution.

    Parameters
    ----------
    symbols : np.ndarray or torch.Tensor
        Integers in ``0 .. num_symbols - 1`` (any integer dtype, any shape; flattened). uint8
        (alphabets up to 256) or uint16 symbols are coded without a conversion pass. A CUDA tensor
        is counted on its device and copied to the host for coding (same bytes as on the CPU).
    num_symbols : int
        Alphabet size, 1 to 65536.
    counts : array of int, optional
        The histogram of ``symbols`` (``num_symbols`` entries, what :func:`symbol_counts`
        returns), when the caller already has it (a quantizer kernel counting in its own pass):
        the histogram pass is skipped. It must be exact: a symbol it says is absent raises
        ValueError; other wrong counts give bytes the decoder rejects.

    Returns
    -------
    np.ndarray
        uint8 bytes: the count table followed by the rANS section (see the module docstring).
    """
    _check_num_symbols(num_symbols)
    if _is_device_tensor(symbols):
        flat = _checked_on_device(symbols, num_symbols)
        if counts is None:
            counts = _device_counts(flat, num_symbols)
        symbols = _to_host(flat, num_symbols)
    elif _is_tensor(symbols):
        symbols = symbols.numpy()
    plan = _plan(symbols, num_symbols, counts)
    return plan if isinstance(plan, np.ndarray) else encode_section(*plan)


def _plan(symbols, num_symbols: int, counts) -> np.ndarray | tuple:
    """:func:`entropy_encode` up to the rANS coder: its bytes when no rANS section follows (no
    symbols, or one distinct), else :func:`encode_section`'s arguments."""
    canon, checked = _canonical(symbols, num_symbols)
    n = int(canon.size)
    if n > MAX_COUNT:
        raise ValueError(f"at most {MAX_COUNT} symbols per call, got {n}")
    counts_given = counts
    counts = _counts_of(canon, num_symbols) if counts is None else _validated_counts(counts, n, num_symbols)
    if n == 0:
        return np.zeros(0, np.uint8)
    present = np.flatnonzero(counts)
    header = _table_bytes(present, counts[present])
    if present.size == 1:
        if not checked and not bool((canon == present[0]).all()):
            raise ValueError("counts= names one symbol, but the symbols hold others")
        return header
    layout, freq = choose_layout(counts[present], n)
    if canon.itemsize == 1:
        rows = 256
    else:  # the table covers every value the symbols hold: checked by the histogram, or here
        top = int(present[-1]) if checked or counts_given is None else max(int(present[-1]), int(canon.max()))
        rows = top + 1
    return canon, present, freq, layout, header, rows


def entropy_encode_runs(symbols: np.ndarray, sizes, num_symbols: int, counts=None) -> list[np.ndarray]:
    """:func:`entropy_encode` of each run of ``symbols`` (runs of ``sizes`` symbols, in order; row
    ``t`` of ``counts``, if given, the histogram of run ``t``): the same bytes, one array per run.

    With uint8 symbols the one-lane rans32 blocks of all runs are coded together, four in one
    loop (:func:`fedquant.wire.rans.encode_one_lane32`): a lone state's chain of dependent
    multiplications leaves most of a core idle (docs/ENTROPY_CODER.md).
    """
    from fedquant.jit import use_twin

    sizes = np.asarray(sizes, np.int64)
    flat = np.asarray(symbols).reshape(-1)
    together = flat.dtype == np.uint8 and num_symbols <= 256 and flat.flags.c_contiguous and not use_twin(flat)
    out: list[np.ndarray | None] = []
    pending = []  # (run, symbols start, present, freq, layout, header)
    start = 0
    for t, size in enumerate(sizes):
        run = flat[start : start + size]
        plan = _plan(run, num_symbols, None if counts is None else counts[t])
        if isinstance(plan, np.ndarray):
            out.append(plan)
        elif together and plan[3].coder == "rans32" and plan[3].lanes == 1:
            pending.append((len(out), start, *plan[1:5]))
            out.append(None)
        else:
            out.append(encode_section(*plan))
        start += size
    if pending:
        _encode_one_lane_runs(flat, sizes, pending, out)
    return out


def _encode_one_lane_runs(flat: np.ndarray, sizes: np.ndarray, pending: list, out: list) -> None:
    """Code the pending one-lane rans32 runs of :func:`entropy_encode_runs` together into ``out``."""
    from fedquant.wire import rans

    rows, tables, where = [], [], []
    room = 0
    for index, start, present, freq, layout, header in pending:
        n = int(sizes[index])
        block, ends = _section_room(n, layout, 16)
        tables.append(rans.encoder_table32(np.ascontiguousarray(present, np.int64), freq, 256, layout.precision))
        first = len(rows)
        for b in range(ends.size):
            lo = start + b * block
            rows.append(
                (
                    lo,
                    min(lo + block, start + n),
                    len(tables) - 1,
                    layout.precision,
                    room + (ends[b - 1] if b else 0),
                    room + ends[b],
                )
            )
        where.append((index, header, layout, first, len(rows)))
        room += int(ends[-1])
    seg = np.array(rows, np.int64).reshape(-1, 6)
    order = np.argsort(seg[:, 1] - seg[:, 0], kind="stable")  # blocks of like lengths side by side
    words = _scratch_words(room, np.uint16)
    starts = np.empty(seg.shape[0], np.int64)
    ok = np.zeros(seg.shape[0], np.bool_)
    sorted_starts = np.empty_like(starts)
    sorted_ok = np.zeros_like(ok)
    rans.encode_one_lane32(flat, np.ascontiguousarray(seg[order]), np.stack(tables), words, sorted_starts, sorted_ok)
    starts[order], ok[order] = sorted_starts, sorted_ok
    if not ok.all():
        raise ValueError("the symbols hold a value that counts= says is absent (or beyond num_symbols)")
    for index, header, layout, first, last in where:
        out[index] = _assembled(header, layout, words, starts[first:last], seg[first:last, 5])


def encode_section(
    symbols: np.ndarray,
    present: np.ndarray,
    freq: np.ndarray,
    layout: Layout,
    header: np.ndarray,
    rows: int | None = None,
) -> np.ndarray:
    """``header`` followed by the rANS section of canonical ``symbols`` coded with ``layout``.

    ``present`` are the symbol values with a frequency (increasing), ``freq`` their frequencies
    (``quantize_counts`` of their counts at ``layout.precision``), ``rows`` a bound on the values
    of uint16 symbols (default: 65536; uint8 symbols always get 256 rows). Tests and the fuzzer
    call it with layouts the encoder's own choice would not pick for a short stream.
    """
    from fedquant.wire import rans

    n = symbols.size
    p, lanes, b, coder = layout.precision, layout.lanes, layout.block_log2, layout.coder
    if coder not in _CODERS:
        raise ValueError(f"invalid layout {layout}: unknown coder")
    word_bits, max_lanes_log2 = _CODERS[coder]
    top = MAX_PRECISION32 if coder == "rans32" else MAX_PRECISION
    if not (1 <= p <= top and (1 << p) >= present.size and lanes in [1 << j for j in range(max_lanes_log2 + 1)]):
        raise ValueError(f"invalid layout {layout} for {present.size} symbols")
    if b is not None and not (MIN_BLOCK_LOG2 <= b <= MAX_BLOCK_LOG2 and n > 1 << b):
        raise ValueError(f"invalid layout {layout} for {n} symbols")
    block, ends = _section_room(n, layout, word_bits)
    num_blocks = ends.size
    # uint8 symbols always get every row: the vector encoder reads a row per symbol unchecked.
    rows = 256 if symbols.itemsize == 1 else 65536 if rows is None else rows
    syms = np.ascontiguousarray(present, np.int64)
    starts = np.empty(num_blocks, np.int64)
    ok = np.zeros(num_blocks, np.bool_)
    if coder == "rans32":
        table = rans.encoder_table32(syms, freq, rows, p)
        out = _scratch_words(int(ends[-1]), np.uint16)
        rans.encode_blocks32(symbols, block, lanes, table, p, out, ends, starts, ok)
    else:
        table = rans.encoder_table(syms, freq, rows, p)
        out = _scratch_words(int(ends[-1]), np.uint32)
        rans.encode_blocks(symbols, block, lanes, table, out, ends, starts, ok)
    if not ok.all():
        raise ValueError("the symbols hold a value that counts= says is absent (or beyond num_symbols)")
    return _assembled(header, layout, out, starts, ends)


def _section_room(n: int, layout: Layout, word_bits: int) -> tuple[int, np.ndarray]:
    """``(block, ends)``: symbols per block and where each block's room of words ends."""
    b, p, lanes = layout.block_log2, layout.precision, layout.lanes
    block = n if b is None else 1 << b
    num_blocks = -(-n // block)
    sizes = np.full(num_blocks, block, np.int64)
    sizes[-1] = n - block * (num_blocks - 1)
    # Each symbol adds at most P + 0.2 bits to the state (rans.py): room for any valid block.
    return block, np.cumsum(sizes * (p + 1) // word_bits + 2 * lanes + 8)


def _assembled(header: np.ndarray, layout: Layout, out: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """The section's bytes: ``header``, the rANS header and the blocks' words ``out[starts[b]:ends[b]]``."""
    p, lanes, b = layout.precision, layout.lanes, layout.block_log2
    word_bits = _CODERS[layout.coder][0]
    lengths = ends - starts
    flags = (p - 1) | (_RANS32 if layout.coder == "rans32" else 0) | (_MULTI_BLOCK if b else 0)
    head = [header, np.array([flags, lanes.bit_length() - 1], np.uint8)]
    if b is not None:
        head += [np.array([b], np.uint8), lengths[:-1].astype("<u4").view(np.uint8)]
    head_size = sum(h.size for h in head)
    word_bytes = word_bits // 8
    result = np.empty(head_size + word_bytes * int(lengths.sum()), np.uint8)
    pos = 0
    for h in head:
        result[pos : pos + h.size] = h
        pos += h.size
    words = result[pos:].view(out.dtype.newbyteorder("<"))
    pos = 0
    for start, end in zip(starts, ends, strict=True):
        words[pos : pos + end - start] = out[start:end]
        pos += end - start
    return result


def _scratch_words(size: int, dtype: type) -> np.ndarray:
    """An uninitialised ``dtype`` array of ``size`` words for the encoder, reused by this thread's calls.

    The encoder writes each block's words backwards into room sized for any valid block (about
    1.6 bytes per symbol), then copies the words out. A fresh buffer of that size is faulted in
    page by page on every call (glibc maps arrays above 32 MiB anew each time): at 25M symbols
    that took the 2-thread encoder from ~2,400 to ~330 M symbols/s. The buffer is kept per
    thread (each thread's encodes are sequential), grown when a larger stream comes, and never
    above 1 GiB (larger streams get a fresh one).
    """
    nbytes = size * np.dtype(dtype).itemsize
    if nbytes > _SCRATCH_MAX_BYTES:
        return np.empty(size, dtype)
    buf = getattr(_SCRATCH, "words", None)
    if buf is None or buf.nbytes < nbytes:
        buf = _SCRATCH.words = np.empty(max(nbytes, 1 << 16), np.uint8)
    return buf[:nbytes].view(dtype)


def entropy_decode(data, count: int, num_symbols: int) -> np.ndarray:
    """Inverse of :func:`entropy_encode` for untrusted ``data``.

    Parameters
    ----------
    data : bytes, memoryview or uint8 np.ndarray
        The coded bytes.
    count : int
        Number of symbols the caller expects (it allocates at most this many).
    num_symbols : int
        Alphabet size the caller expects.

    Returns
    -------
    np.ndarray
        ``count`` symbols, uint8 if ``num_symbols <= 256`` else uint16.

    Raises
    ------
    PayloadError
        If the table is malformed or inconsistent with ``count`` and ``num_symbols``, the header
        or the block lengths are invalid, or the rANS words are truncated, extended or corrupt.
    """
    _check_num_symbols(num_symbols)
    if not 0 <= count <= MAX_COUNT:
        raise ValueError(f"count must be in 0..{MAX_COUNT}, got {count}")
    buf = data.reshape(-1) if isinstance(data, np.ndarray) else np.frombuffer(data, np.uint8)
    if buf.dtype != np.uint8:
        raise ValueError(f"coded data must be uint8 bytes, got dtype {buf.dtype}")
    dtype = _symbol_dtype(num_symbols)
    if count == 0:
        if buf.size:
            raise PayloadError(f"entropy-coded section of 0 symbols holds {buf.size} bytes")
        return np.zeros(0, dtype)

    # The table: k, then k (gap, count) pairs. Bound k before decoding the pairs.
    max_k = min(num_symbols, count)
    limit = ((1 + 2 * max_k) * _MAX_CODEWORD_BITS + 7) // 8
    head = buf[:limit]
    (k,), _ = elias_omega_decode_prefix(head, 1, max(max_k, 1))
    k = int(k)
    pairs, nbits = elias_omega_decode_prefix(head, 1 + 2 * k, max(num_symbols, count))
    gaps, counts = pairs[1::2], pairs[2::2].astype(np.int64)
    symbols = np.cumsum(gaps) - 1  # gaps >= 1, so strictly increasing
    if int(symbols[-1]) >= num_symbols:
        raise PayloadError(f"entropy table names symbol {int(symbols[-1])}, the alphabet has {num_symbols}")
    if int(counts.sum()) != count:
        raise PayloadError(f"entropy table counts sum to {int(counts.sum())}, expected {count} symbols")
    rest = buf[(nbits + 7) // 8 :]
    if nbits % 8 and int(buf[nbits // 8]) & ((1 << (8 - nbits % 8)) - 1):
        raise PayloadError("entropy table has nonzero padding bits")
    if k == 1:
        if rest.size:
            raise PayloadError(f"entropy-coded section of one distinct symbol has {rest.size} trailing bytes")
        return np.full(count, symbols[0], dtype)
    layout, words, offsets = _read_section(rest, count, k, counts)
    return _decode_blocks(words, offsets, count, layout, symbols.astype(dtype), counts, dtype)


def _read_section(rest: np.ndarray, count: int, k: int, counts: np.ndarray) -> tuple[Layout, np.ndarray, np.ndarray]:
    """The layout, the words (aligned, read-only) and the block offsets of a rANS section, all checked."""
    if rest.size < 2:
        raise PayloadError("rANS section is missing its header bytes")
    flags, lanes_log2 = int(rest[0]), int(rest[1])
    if flags & _RESERVED:
        raise PayloadError(f"rANS section header {flags:#04x} sets a reserved bit")
    coder = "rans32" if flags & _RANS32 else "rans64"
    word_bits, max_lanes_log2 = _CODERS[coder]
    precision = (flags & 0x1F) + 1
    top = MAX_PRECISION32 if coder == "rans32" else MAX_PRECISION
    if precision > top or (1 << precision) < k:
        raise PayloadError(f"{coder} section names precision {precision} for {k} symbols (at most {top})")
    if lanes_log2 > max_lanes_log2:
        raise PayloadError(f"{coder} section names 2**{lanes_log2} lanes (at most {1 << max_lanes_log2})")
    lanes = 1 << lanes_log2
    pos, block_log2, num_blocks = 2, None, 1
    if flags & _MULTI_BLOCK:
        if rest.size < 3:
            raise PayloadError("rANS section is missing its block size")
        block_log2 = int(rest[2])
        if not MIN_BLOCK_LOG2 <= block_log2 <= MAX_BLOCK_LOG2:
            raise PayloadError(
                f"rANS blocks of 2**{block_log2} symbols (allowed 2**{MIN_BLOCK_LOG2}..2**{MAX_BLOCK_LOG2})"
            )
        num_blocks = -(-count // (1 << block_log2))
        if num_blocks < 2:
            raise PayloadError(f"rANS section names blocks of 2**{block_log2} for {count} symbols, one block")
        pos = 3 + 4 * (num_blocks - 1)
        if rest.size < pos:
            raise PayloadError(f"rANS section is too short for the lengths of its {num_blocks} blocks")
    body = rest[pos:]
    word_bytes = word_bits // 8
    if body.size % word_bytes:
        raise PayloadError(f"{coder} words take {body.size} bytes, not a multiple of {word_bytes}")
    # A guard against forged tables that declare many symbols over a few bytes. Each rANS step
    # grows the state by at least log2(2**P / f) + log2(1 - f / x) bits, and the state x is at
    # least 2**7 f (rans64) or 2**3 f (rans32) when it is divided by f, so a valid section holds
    # at least n * (cross-entropy - 0.0113) or n * (cross-entropy - 0.193) bits, and the
    # cross-entropy is at least H (Gibbs).
    info = _information_bits(counts)
    slack = 1 / 64 if coder == "rans64" else 0.2
    if body.size * 8 < (info - count * slack) * (1 - 1e-9):
        raise PayloadError(
            f"rANS section of {body.size} bytes is too short for {count} symbols of {info / count:.3f} bits each"
        )
    num_words = body.size // word_bytes
    lengths = np.empty(num_blocks, np.int64)
    if num_blocks > 1:
        lengths[:-1] = rest[3:pos].view("<u4")
    lengths[-1] = num_words - int(lengths[:-1].sum())
    if int(lengths.min()) < 2 * lanes:
        raise PayloadError(f"a rANS block holds fewer words than its {lanes} coder states need")
    offsets = np.zeros(num_blocks + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    dtype = "<u2" if coder == "rans32" else "<u4"
    words = body.view(dtype) if body.ctypes.data % word_bytes == 0 else body.copy().view(dtype)
    words = words.view()
    words.flags.writeable = False  # one kernel signature, whatever buffer the payload came in
    return Layout(precision, lanes, block_log2, coder), words, offsets


def _decode_blocks(
    words: np.ndarray, offsets: np.ndarray, count: int, layout: Layout, present: np.ndarray, counts: np.ndarray, dtype
) -> np.ndarray:
    from fedquant.wire import rans

    p = layout.precision
    freq = quantize_counts(counts, count, p)
    block = count if layout.block_log2 is None else 1 << layout.block_log2
    out = np.empty(count, dtype)
    status = np.zeros(offsets.size - 1, np.int64)
    if layout.coder == "rans32":  # precision <= 12: direct tables of at most 4096 slots
        freq_offset, symbol = rans.direct_table(present, freq, p)
        vector = rans.decoder_table32(present, freq, p) if out.itemsize == 1 else np.zeros(0, np.uint32)
        rans.decode_blocks32(words, offsets, out, block, layout.lanes, p, (vector, freq_offset, symbol), status)
        return _checked_status(status, out)
    # Lookup tables sized by the work: a direct table when small enough, buckets of slots otherwise.
    if p <= rans.MAX_DIRECT_PRECISION and 1 << p <= max(_DIRECT_MIN, 8 * count):
        freq_offset, symbol = rans.direct_table(present, freq, p)
        bucket, cum = np.zeros(0, np.int64), np.zeros(0, np.uint64)
    else:
        freq_offset, symbol = np.zeros(0, np.uint32), np.zeros(0, dtype)
        bucket, cum = rans.bucket_table(freq, p, min(p, rans.BUCKET_BITS, max(8, count.bit_length() + 1)))
    lookup = (freq_offset, symbol, bucket, cum, present)
    rans.decode_blocks(words, offsets, out, block, layout.lanes, p, lookup, status)
    return _checked_status(status, out)


def _checked_status(status: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``out``, or PayloadError naming the first block whose status is not 0."""
    bad = np.flatnonzero(status)
    if bad.size:
        where = f" (block {int(bad[0])} of {status.size})" if status.size > 1 else ""
        raise PayloadError(f"rANS section {_PROBLEMS[int(status[bad[0]])]}{where}")
    return out
