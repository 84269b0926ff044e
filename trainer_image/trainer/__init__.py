"""The training image's package: ``python -m trainer`` (``cli.py``), its checkpoint layout and shard format."""

import os
import warnings

# NVRx 0.4.1 depends on `pynvml`, now a shim over nvidia-ml-py that warns when imported, which `import torch` does
# (torch.cuda). The line ("please report this to the maintainers") would open every rank's, writer's and standby's
# log. Silenced here, before torch, and for the processes this one starts (spawned checkpoint writers, the standby,
# evaluation): through the environment, which they inherit.
PYNVML_WARNING = "ignore:The pynvml package is deprecated:FutureWarning"
warnings.filterwarnings("ignore", message="The pynvml package is deprecated", category=FutureWarning)
if PYNVML_WARNING not in os.environ.get("PYTHONWARNINGS", ""):
    os.environ["PYTHONWARNINGS"] = ",".join(filter(None, (os.environ.get("PYTHONWARNINGS"), PYNVML_WARNING)))
