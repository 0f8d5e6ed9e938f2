"""The goodput benchmark: simulated-engine runs, goodput search, reports and plots.

Layers, each usable alone:

* :mod:`.runner`      one simulated run (policy × workload × profile × rate × seed), in-process or over gRPC;
* :mod:`.goodput`     the goodput search (exponential bracketing, then bisection) over those runs;
* :mod:`.executor`    run independent jobs in parallel (process pool or Ray) with a progress bar;
* :mod:`.experiments` the ``bench`` experiments (goodput, overload, burst, window, ablation);
* :mod:`.report`, :mod:`.plots`  tables, JSON/CSV files and PNG figures;
* :mod:`.command`     the ``slidingserve bench`` and ``slidingserve demo`` subcommands.
"""

from __future__ import annotations
