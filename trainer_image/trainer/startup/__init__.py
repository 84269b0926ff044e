"""How a process of a node comes to life: fork server -> worker -> warm-up.

1. **Fork server** (``forkserver.py``, knob ``TRAINER_FORKSERVER``): ``entrypoint.sh`` starts one per node before
   ``ft_launcher``. It imports torch, NVRx and the trainer once, checks that it may fork (one thread, no CUDA), and
   forks on request every worker, warm standby and checkpoint writer of the node, so none of them imports them
   again. Beside it, also before ``ft_launcher``, ``entrypoint.sh`` starts the warm-up's first stage, which compiles
   the run's Triton kernels into the on-disk cache with no device (``warmup.py``).
2. **Worker**: ``ft_launcher`` launches ``python -m trainer`` as ever. Before it imports torch, the launched process
   hands itself over (``handoff.py``, standard library only) to a process that has imported everything already:
   this local rank's warm standby (``standby.py``, knob ``TRAINER_STANDBY``, which has also made its CUDA context
   and warmed the kernels), else a child that the fork server forks for it. The taker takes the launched process's
   environment, working directory, stdio, command line and start clock and runs the trainer's ``main``; the
   launched process stays as its proxy before ``ft_launcher``. With neither (or a refusal), the launched process
   imports everything and runs itself.
3. **Warm-up** (``warmup.py``): the kernels a step calls, warmed before the first step needs them. One mechanism,
   its callers choosing what differs: the compile stage in its own process per node; a standby before it is taken,
   synchronously, at small shapes; a new GPU worker in a background thread at the run's shapes, joined before the
   first step.

Where the time of a start goes, phase by phase, and the names the processes of a start share through the
environment (where the standbys and the fork server listen, the first-step marker): ``phases.py``.

This package's ``__init__`` imports nothing, ``phases`` only the standard library and ``handoff`` only that and
``phases``: a launched worker imports them before torch. ``warmup`` imports torch in the functions that use it.
"""
