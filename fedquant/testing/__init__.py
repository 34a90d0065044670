"""Test tooling that ships with the package: the payload fuzzer of ``tests`` and ``benchmarks.fuzz``.

:mod:`fedquant.testing.fuzz_mutations` mutates valid payloads of every registered codec;
:mod:`fedquant.testing.fuzzing` decodes them in worker subprocesses and counts the outcomes.
"""
