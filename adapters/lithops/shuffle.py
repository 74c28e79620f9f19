"""The drop-in shuffle for Lithops map/reduce jobs, shuffling through pocketflow.

This is the documented home of the shuffle; the code lives in the installed package, in
:mod:`pocketflow.integrations.lithops_shuffle`, because Lithops pickles task functions into
worker subprocesses (of ``sys.executable``, from any working directory) and those must import it
(``adapters/`` is not an installed package). Import it from either place::

    from pocketflow.integrations.lithops_shuffle import shuffle   # works everywhere
    from adapters.lithops.shuffle import shuffle                   # from a source checkout

One call over a ``lithops.FunctionExecutor``::

    result = shuffle(fexec, mapper, reducer, inputs, reducers=R, cluster=cluster,
                     input_size_bytes=n, persist_output=True)

- ``mapper(item, emit)`` calls ``emit(partition, data)``; ``reducer(partition, inputs)`` gets
  one ``bytes`` per mapper and returns its output.
- The shuffle registers a pocketflow job with hints (mappers + reducers as the most concurrent
  tasks, the input size as the data size), writes one object per (mapper, reducer), reads each
  with DELETE, writes outputs with PERSIST when ``persist_output``, and deregisters the job at the
  end, also when the job fails.
- Reducers are submitted with the mappers and wait for their inputs on the storage servers (the
  ``wait`` action parks the call until the keys are put): no polling on ``not_found``.
- When a storage server dies mid-shuffle, reducers report the mapper outputs that were lost; the
  driver reruns those mappers for the lost partitions only and reruns the reducers (bounded).

The sort in ``examples/sort.py`` and ``pocketflow demo`` use it; ``benchmarks/lithops_sort.py``
compares it with shuffling through Lithops' own localhost and redis storage.
"""

from pocketflow.integrations.lithops_shuffle import (
    OUTPUT_BUCKET,
    SHUFFLE_BUCKET,
    OutputInfo,
    ShuffleResult,
    output_key,
    refresh_map,
    shuffle,
    shuffle_key,
)

__all__ = [
    "OUTPUT_BUCKET",
    "SHUFFLE_BUCKET",
    "OutputInfo",
    "ShuffleResult",
    "output_key",
    "refresh_map",
    "shuffle",
    "shuffle_key",
]
