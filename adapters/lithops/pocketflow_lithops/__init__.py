"""pocketflow for Lithops: the ``pocket`` storage backend (:mod:`pocketflow_lithops.storage`, its
put flags per Lithops object kind in :mod:`pocketflow_lithops.object_kinds`) and
the drop-in shuffle for map/reduce jobs (:mod:`pocketflow_lithops.shuffle`), both over
pocketflow's public API only. Installed with ``pip install adapters/lithops`` (``make install``
does it); the import hook ``_pocketflow_lithops`` makes Lithops find the backend as
``lithops.storage.backends.pocket`` in every process, workers included."""
