"""The example video-analytics pipeline (THIS: decode, then detect faces), importable as
``pocketflow_this_examples``; ``pocketflow-this demo`` runs it."""
