"""The trainer's half of bridge mode `shared`: its parameters become views into one buffer that
vLLM maps too, laid out the way vLLM holds the model.

vLLM does not hold a HF model's parameters one for one. It fuses some (`qkv_proj` is the rows of
`q_proj`, `k_proj`, `v_proj` stacked, biases likewise; `gate_up_proj` is `gate_proj` over
`up_proj`) and pads the vocabulary dimension of the embedding and the output head to a multiple of
64 rows. `plan_layout` turns a HF model into that layout: one `Slot` per vLLM parameter, each made
of the HF parameters (`Part`s) stacked in vLLM's row order, placed at an offset of one flat buffer.
`share_parameters` allocates the buffer, copies the model's values in and re-points every HF
parameter at its rows (`param.data = rows`), so the optimizer, which updates parameters in place,
writes straight into what vLLM reads. The `Parameter` objects stay the same ones: an optimizer
built before, and its state, stay valid. Buffers (rotary frequencies) are not touched; they stay
what the model's own code built from its config. Tied input/output embeddings are one parameter
in HF and in vLLM, so they are one slot.

Where the buffer lives:
- CPU: a file `weights.bin` in a run-scoped directory under /dev/shm, mapped shared
  (`torch.from_file(shared=True)`); vLLM's worker maps the same file. The file outlives a vLLM
  crash, so a relaunched vLLM re-attaches to the current weights.
- CUDA: one tensor on the trainer's device, exported as a CUDA IPC handle (`cuda_ipc.pkl`); vLLM's
  worker, on the same device, opens it. The trainer owns the memory on both kinds of device.

`layout.json` beside it describes the slots; `grpod.weights.shared_ext` reads it. Anything that
cannot be mapped (a fused shard missing, mixed dtypes, a shape vLLM does not share) is a
`SharedLayoutError` naming the parameter: a parameter is never left out or zero-filled.

Only torch, structlog, `grpod.dtypes` and the standard library are imported here: vLLM's worker imports this module.
"""

from __future__ import annotations

import ctypes
import json
import os
import pickle
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch

from grpod.dtypes import TORCH_DTYPES

log = structlog.get_logger(__name__)

LAYOUT_FILE = "layout.json"
WEIGHTS_FILE = "weights.bin"
CUDA_IPC_FILE = "cuda_ipc.pkl"
LAYOUT_FORMAT = 1
# vLLM's VocabParallelEmbedding / ParallelLMHead pad the vocabulary to this many rows
# (vllm.model_executor.layers.vocab_parallel_embedding.DEFAULT_VOCAB_PADDING_SIZE).
VOCAB_PADDING_ROWS = 64
# Slot offsets are multiples of 64 elements (256 bytes in fp32): every slot starts cache-line and
# SIMD aligned, as a tensor of its own would.
SLOT_ALIGN_ELEMENTS = 64
# HF module name -> (vLLM fused module name, shard index): vLLM's packed_modules_mapping for the
# Llama / Qwen2 / Mistral family.
FUSED_SHARDS: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
SHARDS_PER_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


class SharedLayoutError(RuntimeError):
    """A parameter cannot be placed in, or mapped from, the shared buffer; the message names it."""


@dataclass(frozen=True)
class Part:
    """HF parameter `source` occupies rows [row, row + rows) of its slot."""

    source: str
    row: int
    rows: int


@dataclass(frozen=True)
class Slot:
    """One vLLM parameter: `shape` at element `offset` of the buffer, made of `parts`."""

    name: str
    offset: int
    shape: tuple[int, ...]
    parts: tuple[Part, ...]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        return flat[self.offset : self.offset + self.numel].view(self.shape)


@dataclass(frozen=True)
class SharedLayout:
    """Where every vLLM parameter lies in the shared buffer, and which HF parameters fill it."""

    slots: tuple[Slot, ...]
    dtype: str
    numel: int
    storage: str = "file"  # "file" (CPU, /dev/shm) or "cuda_ipc"
    device_uuid: str | None = None

    @property
    def nbytes(self) -> int:
        return self.numel * TORCH_DTYPES[self.dtype].itemsize

    @property
    def torch_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.dtype]

    def to_json(self) -> dict:
        return {
            "format": LAYOUT_FORMAT,
            "dtype": self.dtype,
            "numel": self.numel,
            "storage": self.storage,
            "device_uuid": self.device_uuid,
            "slots": [
                {
                    "name": s.name,
                    "offset": s.offset,
                    "shape": list(s.shape),
                    "parts": [[p.source, p.row, p.rows] for p in s.parts],
                }
                for s in self.slots
            ],
        }

    @classmethod
    def from_json(cls, data: dict) -> SharedLayout:
        if data.get("format") != LAYOUT_FORMAT:
            raise SharedLayoutError(
                f"shared layout format {data.get('format')!r} is not {LAYOUT_FORMAT}: the trainer and vLLM's "
                "worker run different grpod versions; restart both from one installation"
            )
        slots = tuple(
            Slot(s["name"], int(s["offset"]), tuple(s["shape"]), tuple(Part(p[0], p[1], p[2]) for p in s["parts"]))
            for s in data["slots"]
        )
        return cls(slots, data["dtype"], int(data["numel"]), data["storage"], data.get("device_uuid"))

    def save(self, directory: Path) -> Path:
        """Write `layout.json` atomically (a reader never sees half of it)."""
        path = Path(directory) / LAYOUT_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.to_json()))
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, directory: Path) -> SharedLayout:
        path = Path(directory) / LAYOUT_FILE
        try:
            return cls.from_json(json.loads(path.read_text()))
        except FileNotFoundError:
            raise SharedLayoutError(f"no shared layout at {path}: the trainer has not shared its weights there") from None


def padded_rows(rows: int, multiple: int = VOCAB_PADDING_ROWS) -> int:
    return -(-rows // multiple) * multiple


def _vocab_parameters(model: torch.nn.Module) -> set[int]:
    """ids of the parameters vLLM pads to a multiple of 64 rows: embeddings and the output head."""
    found = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None and getattr(head, "weight", None) is not None:
        found.add(id(head.weight))
    return found


def _vllm_name(hf_name: str) -> tuple[str, int | None]:
    """The vLLM parameter `hf_name` lives in, and its shard index there (None: not fused)."""
    module, _, leaf = hf_name.rpartition(".")
    parent, _, last = module.rpartition(".")
    if last in FUSED_SHARDS:
        fused, index = FUSED_SHARDS[last]
        return f"{parent}.{fused}.{leaf}" if parent else f"{fused}.{leaf}", index
    return hf_name, None


def plan_layout(model: torch.nn.Module) -> SharedLayout:
    """vLLM's layout of `model`'s parameters in one flat buffer (see the module docstring)."""
    named = list(model.named_parameters())  # tied parameters appear once, under their first name
    if not named:
        raise SharedLayoutError("the model has no parameters to share")
    dtypes = {p.dtype for _, p in named}
    if len(dtypes) != 1:
        mixed = ", ".join(f"{n} {p.dtype}" for n, p in named if p.dtype != named[0][1].dtype)[:300]
        raise SharedLayoutError(f"shared weights need one dtype; the model mixes {named[0][1].dtype} with: {mixed}")
    dtype = next(iter(dtypes))
    dtype_name = next((k for k, v in TORCH_DTYPES.items() if v == dtype), None)
    if dtype_name is None:
        raise SharedLayoutError(f"shared weights support {sorted(TORCH_DTYPES)}, not {dtype}")
    vocab = _vocab_parameters(model)

    groups: dict[str, dict[int, tuple[str, torch.Tensor]]] = {}
    for hf_name, param in named:
        if param.dim() == 0:
            raise SharedLayoutError(f"{hf_name}: a 0-dimensional parameter has no rows to share")
        target, index = _vllm_name(hf_name)
        shards = groups.setdefault(target, {})
        index = 0 if index is None else index
        if index in shards:
            raise SharedLayoutError(f"{hf_name} and {shards[index][0]} both map to {target} in vLLM's layout")
        shards[index] = (hf_name, param)

    slots: list[Slot] = []
    offset = 0
    for target, shards in groups.items():
        first = shards[min(shards)][0]
        if first != target:  # stacked from HF shards: all of them must be there
            fused = target.rsplit(".", 2)[-2]
            expected = SHARDS_PER_FUSED[fused]
            missing = [name for i, name in enumerate(expected) if i not in shards]
            if missing:
                have = ", ".join(name for name, _ in shards.values())
                raise SharedLayoutError(
                    f"{target}: vLLM fuses {', '.join(expected)} into {fused}, but the model has no "
                    f"{', '.join(missing)} beside {have}"
                )
        ordered = [shards[i] for i in sorted(shards)]
        tail = tuple(ordered[0][1].shape[1:])
        for hf_name, param in ordered:
            if tuple(param.shape[1:]) != tail:
                raise SharedLayoutError(
                    f"{hf_name}: shape {tuple(param.shape)} cannot be stacked with {ordered[0][0]} "
                    f"{tuple(ordered[0][1].shape)} into {target}"
                )
        parts, row = [], 0
        for hf_name, param in ordered:
            parts.append(Part(hf_name, row, int(param.shape[0])))
            row += int(param.shape[0])
        if len(ordered) == 1 and id(ordered[0][1]) in vocab:
            row = padded_rows(row)
        slot = Slot(target, offset, (row, *tail), tuple(parts))
        slots.append(slot)
        offset += -(-slot.numel // SLOT_ALIGN_ELEMENTS) * SLOT_ALIGN_ELEMENTS
    return SharedLayout(tuple(slots), dtype_name, offset)


def _map_file(path: Path, numel: int, dtype: torch.dtype, *, create: bool) -> torch.Tensor:
    """Map `path` shared: writes by any process that maps it are seen by all the others."""
    nbytes = numel * dtype.itemsize
    if create:
        free = os.statvfs(path.parent)
        available = free.f_bavail * free.f_frsize
        if available < nbytes:
            raise SharedLayoutError(
                f"shared weights need {nbytes / 2**20:.1f} MiB in {path.parent}, only "
                f"{available / 2**20:.1f} MiB free: enlarge /dev/shm (e.g. docker --shm-size) or use bridge.mode = 'none'"
            )
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, nbytes)
        finally:
            os.close(fd)
    size = path.stat().st_size
    if size != nbytes:
        raise SharedLayoutError(f"{path} holds {size} bytes, the layout needs {nbytes}: it belongs to another model")
    return torch.from_file(str(path), shared=True, size=numel, dtype=dtype)


def device_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def open_shared_buffer(directory: Path, layout: SharedLayout) -> torch.Tensor:
    """Map the buffer `layout` describes (vLLM's side). CUDA: the caller checked the device."""
    directory = Path(directory)
    if layout.storage == "file":
        return _map_file(directory / WEIGHTS_FILE, layout.numel, layout.torch_dtype, create=False)
    if layout.storage == "cuda_ipc":
        rebuild, args = pickle.loads((directory / CUDA_IPC_FILE).read_bytes())
        return rebuild(*args)
    raise SharedLayoutError(f"unknown shared storage {layout.storage!r} in {directory / LAYOUT_FILE}")


def return_freed_memory_to_os() -> None:
    """Give the heap pages of freed weight copies back to the OS (glibc keeps them otherwise),
    so that resident memory shows the single copy. A no-op where glibc is absent."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def lies_within(tensor: torch.Tensor, buffer: torch.Tensor) -> bool:
    """True when all of `tensor`'s memory lies inside `buffer`'s (same device, same mapping)."""
    start = buffer.data_ptr()
    end = start + buffer.numel() * buffer.element_size()
    ptr = tensor.data_ptr()
    return tensor.device == buffer.device and start <= ptr and ptr + tensor.numel() * tensor.element_size() <= end


class SharedWeights:
    """The trainer's shared buffer and the layout of its parameters in it."""

    def __init__(self, directory: Path, layout: SharedLayout, flat: torch.Tensor) -> None:
        self.directory = Path(directory)
        self.layout = layout
        self.flat = flat

    def holds(self, tensor: torch.Tensor) -> bool:
        """True when `tensor`'s memory lies inside the shared buffer."""
        return lies_within(tensor, self.flat)

    def describe(self) -> dict:
        return {
            "directory": str(self.directory),
            "storage": self.layout.storage,
            "slots": len(self.layout.slots),
            "bytes": self.layout.nbytes,
        }


def share_parameters(model: torch.nn.Module, directory: Path) -> SharedWeights:
    """Move `model`'s parameters into a new shared buffer in `directory` (which must be empty or
    absent) and make each parameter a view of its rows there. Values are kept; pad rows are zero.
    """
    directory = Path(directory)
    layout = plan_layout(model)
    params = dict(model.named_parameters())
    device = next(iter(params.values())).device
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    if any(directory.iterdir()):
        raise SharedLayoutError(f"{directory} is not empty: another run's shared weights may live there")
    if device.type == "cpu":
        flat = _map_file(directory / WEIGHTS_FILE, layout.numel, layout.torch_dtype, create=True)
    elif device.type == "cuda":
        from torch.multiprocessing.reductions import reduce_tensor

        flat = torch.zeros(layout.numel, dtype=layout.torch_dtype, device=device)
        layout = SharedLayout(layout.slots, layout.dtype, layout.numel, "cuda_ipc", device_uuid(device))
        (directory / CUDA_IPC_FILE).write_bytes(pickle.dumps(reduce_tensor(flat)))
    else:
        raise SharedLayoutError(f"shared weights support cpu and cuda devices, not {device}")
    for slot in layout.slots:
        view = slot.view(flat)
        for part in slot.parts:
            param = params[part.source]
            if param.device != device:
                raise SharedLayoutError(f"{part.source} is on {param.device}, the other parameters on {device}")
            rows = view[part.row : part.row + part.rows]
            with torch.no_grad():
                rows.copy_(param.data)
            param.data = rows
    layout.save(directory)
    return_freed_memory_to_os()
    log.info("shared_weights_created", directory=str(directory), slots=len(layout.slots), mib=round(layout.nbytes / 2**20, 2))
    return SharedWeights(directory, layout, flat)
