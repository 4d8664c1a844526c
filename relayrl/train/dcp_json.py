"""torch.distributed.checkpoint storage without pickle: the shards' metadata as JSON.

DCP's own ``FileSystemWriter`` pickles its ``Metadata`` into ``.metadata`` and its reader
``pickle.load``s it back, and the default load planner reads non-tensor items (the
optimizer's ``param_groups``) with ``torch.load(weights_only=False)``: resuming from a
checkpoint directory someone else could write ran their code (docs/security.md). Here:

* :class:`JsonWriter` writes DCP's files as usual, then the metadata as
  ``.metadata.json`` (:func:`metadata_to_json`) and removes the pickled ``.metadata``;
* :class:`JsonReader` reads ``.metadata.json`` only (:func:`metadata_from_json`, every field
  checked; ``ValueError`` names what is wrong) and never opens a pickle;
* :class:`SafeLoadPlanner` reads byte items with ``torch.load(weights_only=True)`` (torch's
  restricted loader: tensors and plain containers, no code).

The tensor data files are DCP's, unchanged: loading at another world size re-shards as before.

Imports: torch only.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import ReadItem

JSON_METADATA = ".metadata.json"
PICKLED_METADATA = ".metadata"
FORMAT = 1


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: Any) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def _ints(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or not all(type(v) is int for v in value):
        raise ValueError(f"{what}: expected a list of integers, got {value!r}")
    return value


def _item_to_json(item: Any) -> dict[str, Any]:
    if isinstance(item, BytesStorageMetadata):
        return {"kind": "bytes"}
    chunks = [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in item.chunks]
    dtype = _dtype_name(item.properties.dtype)
    return {"kind": "tensor", "dtype": dtype, "size": list(item.size), "chunks": chunks}


def _item_from_json(fqn: str, data: Any) -> TensorStorageMetadata | BytesStorageMetadata:
    if not isinstance(data, dict) or data.get("kind") not in ("tensor", "bytes"):
        raise ValueError(f"state_dict_metadata[{fqn!r}]: expected kind tensor or bytes")
    if data["kind"] == "bytes":
        return BytesStorageMetadata()
    chunks = [
        ChunkStorageMetadata(
            offsets=torch.Size(_ints(c.get("offsets"), f"{fqn} chunk offsets")),
            sizes=torch.Size(_ints(c.get("sizes"), f"{fqn} chunk sizes")),
        )
        for c in data.get("chunks", [])
        if isinstance(c, dict)
    ]
    return TensorStorageMetadata(
        properties=TensorProperties(dtype=_dtype(data.get("dtype"))),
        size=torch.Size(_ints(data.get("size"), f"{fqn} size")),
        chunks=chunks,
    )


def _storage_to_json(index: MetadataIndex, info: _StorageInfo) -> dict[str, Any]:
    return {
        "fqn": index.fqn,
        "offset": None if index.offset is None else list(index.offset),
        "index": index.index,
        "path": info.relative_path,
        "byte_offset": info.offset,
        "length": info.length,
        "transforms": list(info.transform_descriptors or []) or None,
    }


def _storage_from_json(data: Any) -> tuple[MetadataIndex, _StorageInfo]:
    if not isinstance(data, dict) or not isinstance(data.get("fqn"), str):
        raise ValueError(f"storage_data: malformed entry {data!r}")
    path = data.get("path")
    if not isinstance(path, str) or "/" in path or path.startswith("."):
        raise ValueError(f"storage_data[{data['fqn']!r}]: bad file name {path!r}")
    offset = data.get("offset")
    index = MetadataIndex(
        data["fqn"],
        None if offset is None else _ints(offset, "storage_data offset"),
        data.get("index") if type(data.get("index")) is int else None,
    )
    numbers = [data.get("byte_offset"), data.get("length")]
    if not all(type(n) is int and n >= 0 for n in numbers):
        raise ValueError(f"storage_data[{data['fqn']!r}]: bad byte range {numbers}")
    transforms = data.get("transforms")
    if transforms is not None and not all(isinstance(t, str) for t in transforms):
        raise ValueError(f"storage_data[{data['fqn']!r}]: bad transforms {transforms!r}")
    return index, _StorageInfo(path, numbers[0], numbers[1], transforms)


def metadata_to_json(metadata: Metadata) -> dict[str, Any]:
    """A JSON document holding everything of ``metadata`` that loading needs."""
    planner = metadata.planner_data or {}
    return {
        "format": FORMAT,
        "version": metadata.version,
        "state_dict_metadata": {
            fqn: _item_to_json(item) for fqn, item in metadata.state_dict_metadata.items()
        },
        "planner_data": {fqn: list(path) for fqn, path in planner.items()},
        "storage_data": [
            _storage_to_json(index, info) for index, info in (metadata.storage_data or {}).items()
        ],
    }


def metadata_from_json(data: Any) -> Metadata:
    """The ``Metadata`` of :func:`metadata_to_json`'s document; ``ValueError`` naming the
    first malformed field."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"not a format-{FORMAT} {JSON_METADATA}")
    items = data.get("state_dict_metadata")
    planner = data.get("planner_data")
    storage = data.get("storage_data")
    if not isinstance(items, dict) or not isinstance(planner, dict):
        raise ValueError("state_dict_metadata and planner_data must be mappings")
    if not isinstance(storage, list):
        raise ValueError("storage_data must be a list")
    for fqn, path in planner.items():
        if not isinstance(path, list) or not all(isinstance(p, str | int) for p in path):
            raise ValueError(f"planner_data[{fqn!r}]: expected a list of keys")
    version = data.get("version")
    return Metadata(
        state_dict_metadata={fqn: _item_from_json(fqn, item) for fqn, item in items.items()},
        planner_data={fqn: tuple(path) for fqn, path in planner.items()},
        storage_data=dict(_storage_from_json(entry) for entry in storage),
        storage_meta=StorageMeta(),
        version=version if isinstance(version, str) else None,
    )


class JsonWriter(FileSystemWriter):
    """DCP's file writer with the metadata as JSON (no pickle left in the directory)."""

    def finish(self, metadata: Metadata, results: list[list[Any]]) -> None:
        super().finish(metadata, results)  # fills metadata.storage_data, writes .metadata
        directory = Path(self.path)
        tmp = directory / f"{JSON_METADATA}.tmp"
        with open(tmp, "w") as f:
            json.dump(metadata_to_json(metadata), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, directory / JSON_METADATA)
        (directory / PICKLED_METADATA).unlink(missing_ok=True)


class JsonReader(FileSystemReader):
    """DCP's file reader taking the metadata from :data:`JSON_METADATA` only."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self.path) / JSON_METADATA
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"{path}: unreadable ({exc})") from exc
        metadata = metadata_from_json(data)
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner reading byte items with ``weights_only=True``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded
