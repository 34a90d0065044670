"""Build numba's on-disk cache of every codec's kernels: ``python -m fedquant.codecs.kernels.warmup``.

Encodes and decodes a small (serial kernels) and a large (parallel kernels) tensor with every
registered codec, each of its codings, with ``rht+`` in front and with buckets that do not tile
the kernels' chunks (an unfused path), so the argument types the codecs use are all compiled
once; then marks the cache warm (see :mod:`fedquant.jit.cache`). The cache is this machine's,
used by every copy of the package with the same kernel sources (a ``flwr run`` copy of an app
too). The codecs start it by themselves in the background on their first call with a cold
cache; run it in the foreground after installing to have the compiled kernels from the first
call on (a few minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import fcntl
import os
import signal
import sys
import time

from fedquant.jit import cache

#: Settings that reach kernels the generated specs do not (fractional EDEN rates).
EXTRA_SPECS = ("eden:bits=1.5", "eden:bits=0.5")
#: A bucket size that does not divide the kernels' chunk (the grid codecs' unfused path).
ODD_BUCKET = 1000


def warm_specs() -> list[str]:
    """Every registered codec: defaults, each other coding, ``rht+`` in front, an odd bucket size (those accepted)."""
    from fedquant.codecs import available_codecs, codec_class, get_codec

    specs = []
    for name in available_codecs():
        quantizer = codec_class(name)
        specs += [name, *(f"{name}:coding={coding}" for coding in quantizer.codings[1:]), f"rht+{name}"]
        if "bucket_size" in quantizer.params:
            specs.append(f"{name}:bucket_size={ODD_BUCKET}")
    specs += [s for s in EXTRA_SPECS if s not in specs]
    return [spec for spec in specs if _accepted(get_codec, spec)]


def _accepted(get_codec, spec: str) -> bool:
    try:
        get_codec(spec)
    except ValueError:
        return False
    return True


def exercise(spec: str, sizes: tuple[int, ...]) -> None:
    """Encode and decode a seeded Gaussian tensor of each size with ``spec`` (compiled kernels), and
    take the server's first pass over its deferred values where it has them."""
    import numpy as np
    import torch

    from fedquant.codecs import get_codec

    codec = get_codec(spec)
    for n in sizes:
        x = torch.randn(n, generator=torch.Generator().manual_seed(n))
        estimate = x if codec.needs_side_info else None  # NDQSG decodes against an estimate: the tensor itself
        payload = codec.encode(x, seed=n)
        codec.decode(payload, n, estimate)
        deferred = codec.decode_deferred(payload, n, shape=(n,)) if estimate is None else None
        if deferred is not None:
            deferred.accumulate(np.zeros(n, np.float32), np.zeros(n, np.float32), np.zeros(0), 1.0, 1.0)


def exercise_wire(sizes: tuple[int, ...]) -> None:
    """Encode and decode with every wire coder directly, at the argument types the codecs may reach.

    The codecs' specs reach the rANS coder with uint8 symbols and one Code_s variant per stream (the
    shorter one is sent); this covers uint16 symbols (alphabets above 256), both Code_s decoders,
    and int32 levels (``s > 127``).
    """
    import numpy as np

    from fedquant.wire import elias, entropy

    for n in sizes:
        rng = np.random.default_rng(n)
        for num_symbols in (9, 300):
            symbols = np.minimum(rng.geometric(0.3, n) - 1, num_symbols - 1).astype(entropy._symbol_dtype(num_symbols))
            entropy.entropy_decode(entropy.entropy_encode(symbols, num_symbols), n, num_symbols)
            # Both coders whatever the encoder picks at this size: 32 lanes of rans32, 8 of rans64.
            counts = entropy.symbol_counts(symbols, num_symbols)
            present = np.flatnonzero(counts)
            header = entropy._table_bytes(present, counts[present])
            for layout in (entropy.Layout(12, 32, None, "rans32"), entropy.Layout(16, 8, None, "rans64")):
                freq = entropy.quantize_counts(counts[present], n, layout.precision)
                data = entropy.encode_section(symbols, present, freq, layout, header, num_symbols + 1)
                entropy.entropy_decode(data, n, num_symbols)
        for s in (4, 1000):
            levels = (rng.integers(-s, s + 1, n) * (rng.random(n) < 0.2)).astype(np.int8 if s < 128 else np.int32)
            elias.code_s_decode(elias.code_s_encode(levels)[0], n, s)
            elias.code_s_dense_decode(elias.code_s_dense_encode(levels)[0], n, s)
        values = rng.integers(1, 1 << 40, n, dtype=np.uint64)
        data, nbits = elias.elias_omega_encode(values)
        elias.elias_omega_decode(data, n, 1 << 40, nbits)
        elias.elias_omega_lengths(values)


def exercise_norms(sizes: tuple[int, ...]) -> None:
    """The server's sum-of-squares kernels (:mod:`fedquant.codecs.kernels.norms`), serial and parallel."""
    import numpy as np

    from fedquant.codecs.kernels.norms import (
        accumulate_bounded,
        add_scaled,
        add_scaled_float32,
        add_sum_squares,
        checked_accumulate,
        checked_sum_squares,
        dot_terms,
        dot_terms_many,
        sum_squares,
    )

    for n in sizes:
        x = np.ones(n, np.float32)
        sum_squares(x)
        add_sum_squares(x, x, np.empty_like(x))
        checked_sum_squares(x, x)
        add_scaled(np.zeros(n), x, 0.5)
        add_scaled_float32(np.zeros(n), x, 0.5, np.empty_like(x))
        dot_terms(x, x.astype(np.float64))
        dot_terms(x, x.copy())
        dot_terms_many([x, x], x.astype(np.float64))
        dot_terms_many([x, x], x.copy())
        checked_accumulate(x, x, np.zeros(n, np.float32), np.zeros(n), 0.5)
        checked_accumulate(x, x, np.zeros(0, np.float32), np.zeros(0), 0.5)
        accumulate_bounded(x, x, np.zeros(n, np.float32), np.zeros(n), 0.5, 1.0)
        accumulate_bounded(x, x, np.zeros(0, np.float32), np.zeros(0), 0.5, 1.0)


def warm(*, verbose: bool = True) -> list[tuple[str, str]]:
    """Compile every spec of :func:`warm_specs`; returns the ``(spec, error)`` of those that failed."""
    from fedquant.codecs.kernels.common import PARALLEL_MIN

    os.environ[cache.MODE_ENV] = "numba"
    cache.READY = True
    sizes = (3000, PARALLEL_MIN + 1001)
    failed = []
    t0 = time.perf_counter()
    try:
        exercise_wire(sizes)
    except Exception as err:
        failed.append(("wire coders", f"{type(err).__name__}: {err}"))
    if verbose:
        print(f"{'wire coders':32s} {time.perf_counter() - t0:6.1f} s", flush=True)
    try:
        exercise_norms(sizes)
    except Exception as err:
        failed.append(("update norms", f"{type(err).__name__}: {err}"))
    for spec in warm_specs():
        t0 = time.perf_counter()
        try:
            exercise(spec, sizes)
        except Exception as err:  # a setting a codec refuses (e.g. rht+ twice) is not a warm-up failure
            failed.append((spec, f"{type(err).__name__}: {err}"))
        if verbose:
            print(f"{spec:32s} {time.perf_counter() - t0:6.1f} s", flush=True)
    return failed


def _exit_on_term(folder):
    """A SIGTERM handler that removes the pid file and ends the process at once.

    Raising ``SystemExit`` from the handler did not always end it: a signal that arrives while
    llvmlite runs a Python callback from C (``_raw_object_cache_notify``, during every compile)
    has its exception printed as "ignored", and the warm-up went on compiling for minutes after
    the test or benchmark that stopped it had ended. numba writes each cache file whole (a
    temporary file, then a rename), so nothing is left half-written.
    """

    def handler(signum, frame):
        cache.pid_path(folder).unlink(missing_ok=True)
        os._exit(128 + signum)

    return handler


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--background", action="store_true", help="exit at once if another warm-up runs; niced")
    args = parser.parse_args(argv)
    folder = cache.cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    lock = cache.try_lock(folder)
    if lock is None:
        if args.background:
            return 0
        print(f"another warm-up is running on this machine; waiting for it ({cache.lock_path(folder)})", flush=True)
        lock = open(cache.lock_path(folder), "a")
        fcntl.flock(lock, fcntl.LOCK_EX)
    marker = cache.marker_path(folder)
    if marker.exists():
        print(f"the kernel cache in {folder} is warm already")
        return 0
    if args.background:
        cache.lower_priority(os.getpid())  # started by hand, or by a process that could not
    signal.signal(signal.SIGTERM, _exit_on_term(folder))
    cache.pid_path(folder).write_text(str(os.getpid()))
    t0 = time.perf_counter()
    try:
        failed = warm(verbose=True)
    except Exception as err:  # an interrupted warm-up (Ctrl-C, kill) is not marked failed
        cache.failed_path(folder).write_text(f"{type(err).__name__}: {err}\n")
        raise
    finally:
        cache.pid_path(folder).unlink(missing_ok=True)
    for spec, why in failed:
        print(f"not warmed: {spec}: {why}")
    marker.write_text(f"warmed in {time.perf_counter() - t0:.0f} s by process {os.getpid()}\n")
    print(f"kernel cache in {folder} is warm ({time.perf_counter() - t0:.0f} s)", flush=True)
    lock.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
