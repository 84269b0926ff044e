# Source on the lent GPU machine: installs the carried wheels (NVRx 0.4.1 and its two missing deps) into
# /tmp/site and puts the project on PYTHONPATH (the image's python3 has torch; nothing is pip-installed).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || return 1
export PYTHONPATH="/tmp/site:$PWD/trainer_image:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PATH="/tmp/site/bin:$PATH"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
