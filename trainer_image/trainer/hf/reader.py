"""Hugging Face safetensors read by slices into the sharded model: each rank reads only the rows of its own FSDP2
shards (``Shard(0)``), and for q/k only the whole heads those rows touch (the permutation works per head)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainer.config_checks import ConfigError
from trainer.hf.adapter import LlamaAdapter, head_rows, rope_from_hf
from trainer.hf.errors import BaseModelFilesError

log = logging.getLogger(__name__)

SINGLE = "model.safetensors"
FLOAT_DTYPES = {"F64", "F32", "BF16", "F16"}
"""safetensors dtypes that load (converted to the parameters' dtype); anything else is a quantized checkpoint."""
INDEX = "model.safetensors.index.json"


class SafetensorsFiles:
    """The safetensors files of a Hugging Face model directory (``model.safetensors``, or the shards an
    ``model.safetensors.index.json`` lists), opened lazily; every slice read is counted in ``bytes_read``."""

    def __init__(self, directory: Path) -> None:
        self.dir = Path(directory)
        self.bytes_read = 0
        self._open: dict[str, Any] = {}
        self.weight_map = self._weight_map()
        missing = sorted({f for f in self.weight_map.values() if not (self.dir / f).is_file()})
        if missing:
            raise BaseModelFilesError(
                f"{self.dir}: {len(missing)} safetensors file(s) listed in {INDEX} are missing: {', '.join(missing[:5])}; "
                "download the complete model")

    @staticmethod
    def required_files(directory: Path) -> list[str]:
        """The safetensors files of a complete model in ``directory``: those its index lists, else
        ``model.safetensors``."""
        index = Path(directory) / INDEX
        if not index.is_file():
            return [SINGLE]
        try:
            return sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise BaseModelFilesError(f"{index} is not a safetensors index ({type(exc).__name__}: {exc})") from None

    def _weight_map(self) -> dict[str, str]:
        index = self.dir / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
                raise BaseModelFilesError(f"{index} is not a safetensors index ({type(exc).__name__}: {exc})") from None
            files = weight_map.values() if isinstance(weight_map, dict) else [None]
            if not all(isinstance(v, str) and "/" not in v for v in files):
                raise BaseModelFilesError(f"{index}: weight_map must map tensor names to file names in {self.dir}")
            return weight_map
        if (self.dir / SINGLE).is_file():
            return {name: SINGLE for name in self._file(SINGLE).keys()}
        others = sorted(p.name for p in self.dir.glob("*.bin")) + sorted(p.name for p in self.dir.glob("*.pth"))
        hint = (f" (it has {', '.join(others[:3])}: convert them to safetensors first)" if others else "")
        raise BaseModelFilesError(f"{self.dir} has neither {SINGLE} nor {INDEX}{hint}")

    def _file(self, name: str) -> Any:
        from safetensors import safe_open

        if name not in self._open:
            path = self.dir / name
            try:
                self._open[name] = safe_open(str(path), framework="pt", device="cpu")
            except Exception as exc:  # noqa: BLE001 - safetensors raises its own SafetensorError, OSError, ...
                raise BaseModelFilesError(f"{path} is not a readable safetensors file ({type(exc).__name__}: "
                                          f"{str(exc).splitlines()[0][:200] if str(exc) else ''})") from None
        return self._open[name]

    def names(self) -> list[str]:
        return list(self.weight_map)

    def _slice(self, name: str) -> Any:
        if name not in self.weight_map:
            raise BaseModelFilesError(f"{self.dir}: no tensor {name!r} in the safetensors files; the files do not hold "
                                      "the model its config.json describes")
        file = self.weight_map[name]
        try:
            return self._file(file).get_slice(name)
        except BaseModelFilesError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise BaseModelFilesError(f"{self.dir / file}: tensor {name!r} cannot be read ({type(exc).__name__}: "
                                      f"{exc})") from None

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape; a ConfigError when it is not stored as floating point (a quantized checkpoint)."""
        part = self._slice(name)
        if part.get_dtype() not in FLOAT_DTYPES:
            raise ConfigError(f"model.from_hf: {self.dir}: {name} is stored as {part.get_dtype()}: a quantized "
                              f"checkpoint; give one with {'/'.join(sorted(FLOAT_DTYPES))} weights")
        return tuple(part.get_shape())

    def read(self, name: str, box: tuple[slice, ...]) -> torch.Tensor:
        """The region ``box`` (one slice per dimension) of tensor ``name``; only those bytes are read."""
        try:
            part = self._slice(name)[box]
        except BaseModelFilesError:
            raise
        except Exception as exc:  # noqa: BLE001 - a truncated file fails here
            raise BaseModelFilesError(f"{self.dir / self.weight_map[name]}: tensor {name!r} cannot be read "
                                      f"({type(exc).__name__}: {exc})") from None
        self.bytes_read += part.numel() * part.element_size()
        return part


def load_into(model: nn.Module, adapter: LlamaAdapter, files: SafetensorsFiles) -> dict[str, int]:
    """Fill this rank's shards of every parameter of the (FSDP2-sharded) ``model`` from ``files``; returns
    ``{"bytes_read", "bytes_owned", "tensors"}`` for this rank. Collective-free: every rank reads its own rows."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from trainer.checkpoint.state import local_piece

    state = get_model_state_dict(model)
    owned = 0
    with torch.no_grad():
        for fqn, value in state.items():
            local, piece = local_piece(value)
            name = adapter.hf_name(fqn)
            shape = files.shape(name)
            if shape != piece.global_shape:
                raise BaseModelFilesError(
                    f"{files.dir}: {name} has shape {list(shape)} in the safetensors files but {list(piece.global_shape)} "
                    "in the model its config.json describes; the files and config.json disagree")
            owned += local.numel() * local.element_size()
            if local.numel() == 0:
                continue
            local.copy_(_read_piece(files, adapter, fqn, name, piece.offset, piece.shape))
    set_model_state_dict(model, state)
    unused = [n for n in files.names() if adapter.fqn(n) is None and not adapter.ignorable(n)]
    if unused:
        log.warning("base model %s: %d tensor(s) not used by this model, e.g. %s", files.dir, len(unused), unused[:3])
    return {"bytes_read": files.bytes_read, "bytes_owned": owned, "tensors": len(state)}


def _read_piece(files: SafetensorsFiles, adapter: LlamaAdapter, fqn: str, name: str, offset: tuple[int, ...],
                shape: tuple[int, ...]) -> torch.Tensor:
    rest = tuple(slice(o, o + n) for o, n in zip(offset[1:], shape[1:]))
    heads = adapter.rope_heads(fqn)
    if not heads:
        return files.read(name, (slice(offset[0], offset[0] + shape[0]), *rest))
    head_dim = adapter.head_dim()
    start, stop = head_rows(offset[0], shape[0], head_dim)
    block = rope_from_hf(files.read(name, (slice(start, stop), *rest)), (stop - start) // head_dim)
    return block[offset[0] - start : offset[0] - start + shape[0]]
