"""The LoRA adapters an engine serves: which are known, which are in host memory, which sit in
the device slots, and each step's token -> slot map.

Known adapters (``LoRARequest``: name, id, folder) are read when first registered, which checks
them against the model (``lmplug.loading.peft``); their weights stay in host memory up to
``max_cpu_loras`` (least recently used dropped, read again from the folder when asked for). The
``max_loras`` device slots hold the adapters the latest steps used, least recently used evicted.
A step whose rows ask for more adapters than there are slots runs in groups (``groups``).

Under tensor parallelism rank 0 decides (which adapters are known, which slot holds which) and
each step's message to the workers carries ``take_message()``: the slots rank 0 filled since the
last step (slot, ``LoRARequest``) and the per-token slot map; a worker's ``replay`` fills the same
slots with its shard of each adapter (read from the adapter's folder on that rank) and sets the
map. So loading and unloading at run time reach the workers with the first step that uses them.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import torch

from lmplug.errors import ConfigError
from lmplug.interfaces.adapter import AdapterBackend, AdapterOptions, LoRARequest
from lmplug.interfaces.scheduler import ScheduledSeq
from lmplug.kit.lora import LinearLoRA, attach
from lmplug.loading.peft import HostAdapter, read_adapter


class UnknownAdapter(ConfigError):
    """A request names an adapter the engine does not know (the server answers 404)."""


def cache_salt(request: LoRARequest) -> int:
    """What prefix-cache hashes of this adapter's sequences start from (so two adapters, or an
    adapter and the base model, never share K/V): 128 bits of its id, name and folder."""
    digest = hashlib.blake2b(f"{request.lora_int_id}\0{request.lora_name}\0{request.lora_path}".encode(),
                             digest_size=16).digest()
    return int.from_bytes(digest, "little")


class Adapters:
    def __init__(self, backend: AdapterBackend, options: AdapterOptions, model: torch.nn.Module) -> None:
        self.options = options
        self.layers: dict[str, LinearLoRA] = attach(model, backend, options.max_loras, options.max_lora_rank)
        if not self.layers:
            raise ConfigError("lora: this model's architecture has no linear layers LoRA can adapt "
                              "(the transformers fallback has none): remove the lora: section")
        self.step = model.lora_step
        # the checkpoint's sizes (under tensor parallelism too: adapters are read whole, then sharded)
        self.targets = {prefix: (lin.full_in, lin.full_out[k])
                        for prefix, lin in self.layers.items()
                        for k, p in enumerate(lin.prefixes) if p == prefix}
        # replaced, never changed in place: the server's event loop reads it while the engine
        # thread loads and unloads
        self.known: dict[str, LoRARequest] = {}
        self._host: OrderedDict[str, HostAdapter] = OrderedDict()
        self._slots: OrderedDict[str, int] = OrderedDict()  # resident adapter -> slot, LRU first
        tp = getattr(model, "tp", None)
        self._sends = tp is not None and tp.is_parallel and tp.rank == 0  # rank 0 of a TP group
        self._filled: list[tuple[int, LoRARequest]] = []  # slots filled since ``take_message``
        self._token_slots: list[int] | None = None  # this step's map (None: no step set)

    # -- which adapters --------------------------------------------------------------------------
    def add(self, request: LoRARequest) -> None:
        """Know ``request``'s adapter (read and checked now). The same request again is a no-op;
        another adapter under a known name or id is refused."""
        known = self.known.get(request.lora_name)
        if known == request:
            return
        if known is not None:
            raise ConfigError(f"LoRA adapter {request.lora_name!r} is already loaded (from {known.lora_path}); "
                              "unload it first")
        same_id = next((r for r in self.known.values() if r.lora_int_id == request.lora_int_id), None)
        if same_id is not None:
            raise ConfigError(f"LoRA adapter {request.lora_name!r}: lora_int_id {request.lora_int_id} is "
                              f"already used by adapter {same_id.lora_name!r}")
        self._remember(request.lora_name, self._read(request))
        self.known = {**self.known, request.lora_name: request}

    def remove(self, name: str) -> None:
        if name not in self.known:
            raise UnknownAdapter(f"LoRA adapter {name!r} is not loaded")
        self.known = {n: r for n, r in self.known.items() if n != name}
        self._host.pop(name, None)
        self._slots.pop(name, None)

    def resolve(self, name: str) -> LoRARequest:
        try:
            return self.known[name]
        except KeyError:
            raise UnknownAdapter(f"LoRA adapter {name!r} is not loaded (loaded: "
                                 f"{', '.join(sorted(self.known)) or 'none'})") from None

    # -- a step ----------------------------------------------------------------------------------
    def groups(self, batch: list[ScheduledSeq]) -> list[list[ScheduledSeq]]:
        """The batch in order, cut where a group would need more adapters than there are slots."""
        out: list[list[ScheduledSeq]] = [[]]
        names: set[str] = set()
        for item in batch:
            name = item.seq.adapter
            if name is not None and name not in names:
                if len(names) == self.options.max_loras:
                    out.append([])
                    names = set()
                names.add(name)
            out[-1].append(item)
        return out

    def set_step(self, rows: list[tuple[str | None, int]], device: torch.device) -> None:
        """Each row's adapter (None: the base) and token count, in step order: the slots filled
        and the per-token slot map set for this forward."""
        slots: list[int] = []
        wanted = {name for name, _ in rows if name is not None}
        for name, n in rows:
            slots.extend([-1 if name is None else self._slot(name, wanted)] * n)
        self._token_slots = slots
        self.step.set(slots, device)

    def clear_step(self) -> None:
        self._token_slots = None
        self.step.set(None, torch.device("cpu"))

    # -- tensor parallelism ----------------------------------------------------------------------
    def take_message(self) -> tuple[list[tuple[int, LoRARequest]], list[int] | None]:
        """What the workers need for this step (module docstring); the fills are handed over once."""
        filled, self._filled = self._filled, []
        return filled, self._token_slots

    def replay(self, message: tuple[list[tuple[int, LoRARequest]], list[int] | None], device: torch.device) -> None:
        """A worker: rank 0's fills, then its token -> slot map (None: the base model)."""
        filled, token_slots = message
        for slot, request in filled:
            if self.known.get(request.lora_name) != request:  # new, or unloaded and loaded again
                self._host.pop(request.lora_name, None)
                self.known = {**self.known, request.lora_name: request}
            self._fill(slot, request.lora_name)
        self.step.set(token_slots, device)

    def _slot(self, name: str, wanted: set[str]) -> int:
        slot = self._slots.get(name)
        if slot is not None:
            self._slots.move_to_end(name)
            return slot
        if len(self._slots) < self.options.max_loras:
            taken = set(self._slots.values())
            slot = next(s for s in range(self.options.max_loras) if s not in taken)
        else:
            victim = next(n for n in self._slots if n not in wanted)
            slot = self._slots.pop(victim)
        self._fill(slot, name)
        self._slots[name] = slot
        if self._sends:
            self._filled.append((slot, self.known[name]))
        return slot

    def _fill(self, slot: int, name: str) -> None:
        adapter = self._host_copy(name)
        for prefix, lin in self.layers.items():
            if prefix != lin.prefixes[0]:
                continue  # a fused layer: filled once, from all of its shards
            lin.fill(slot, {k: adapter.modules[p] for k, p in enumerate(lin.prefixes) if p in adapter.modules})

    # -- host copies -----------------------------------------------------------------------------
    def _host_copy(self, name: str) -> HostAdapter:
        adapter = self._host.get(name)
        if adapter is None:
            adapter = self._read(self.resolve(name))
        self._remember(name, adapter)
        return adapter

    def _remember(self, name: str, adapter: HostAdapter) -> None:
        self._host[name] = adapter
        self._host.move_to_end(name)
        while len(self._host) > self.options.host_copies:
            self._host.popitem(last=False)

    def _read(self, request: LoRARequest) -> HostAdapter:
        return read_adapter(request.lora_name, request.lora_path, self.targets, self.options.max_lora_rank)
