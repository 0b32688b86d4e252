"""Reading DCP (torch.distributed.checkpoint) checkpoints without arbitrary unpickling.

Why: DCP stores its ``.metadata`` as a pickle and non-tensor items (optimizer
hyper-parameters) as ``torch.save`` bytes, and reads both back with full unpickling
(``pickle.load``, ``torch.load(weights_only=False)``). The manifest check
(:mod:`.manifest`) already refuses any file that is not the one written; these two
overrides also make a file whose manifest was rewritten to match harmless:

- :class:`SafeFileSystemReader` reads ``.metadata`` with an unpickler that only resolves
  the DCP metadata classes, ``torch.Size``, torch dtypes and layouts (:data:`ALLOWED`):
  anything else, a ``__reduce__`` payload included, is refused with the file named;
- :class:`SafeLoadPlanner` reads the non-tensor items with ``torch.load(weights_only=True)``
  (numbers, strings, tuples, lists, dicts). Tensor shards are already read that way by DCP.
"""

from __future__ import annotations

import io
import pickle

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import StorageMeta

from portarl.trainer.checkpoint.manifest import CheckpointError

_META = "torch.distributed.checkpoint.metadata"
#: (module, name) pairs a DCP ``.metadata`` may refer to (torch 2.x file-system writer).
ALLOWED = {
    (_META, n) for n in ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
                         "ChunkStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"), ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, source: str):
        super().__init__(file)
        self.source = source

    def find_class(self, module, name):
        if (module, name) in ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointError(f"{self.source} refers to {module}.{name}, which a DCP .metadata does not hold: refusing "
                              f"to unpickle it (a tampered or foreign file)", file=self.source)


def load_metadata_safely(data: bytes, source: str):
    try:
        return _MetadataUnpickler(io.BytesIO(data), source).load()
    except CheckpointError:
        raise
    except Exception as err:
        raise CheckpointError(f"{source} cannot be read as DCP metadata ({type(err).__name__}: {err})",
                              file=source) from None


class SafeFileSystemReader(FileSystemReader):
    def read_metadata(self, *args, **kwargs):
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = load_metadata_safely(f.read(), str(path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        """As DCP's own, but ``weights_only=True`` (torch's restricted unpickler)."""
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
