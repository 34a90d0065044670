"""Test tooling that ships with the package: the fuzzers that ``tests`` and ``benchmarks`` run.

:mod:`fedquant.testing.fuzz_mutations` mutates valid payloads of every registered codec;
:mod:`fedquant.testing.fuzzing` decodes them in worker subprocesses and counts the outcomes;
:mod:`fedquant.testing.secagg_fuzz` mutates client replies of a secure-aggregation round.
"""
