"""What a worker does for the router's ``LoadLoRA`` and ``UnloadLoRA`` (both worker services,
``pdserve.shell.service.ShellRpcs``), and the adapters it reports in ``WorkerStats``.

``load`` and ``unload`` run on the engine thread, between two steps, so no step ever sees an
adapter half loaded. A load is idempotent by name: the router sends every adapter it knows to
a worker that does not report it, and a worker started with ``--lora-modules`` holds its
adapters already. Whether a name is in use by another adapter is the router's call (its table
is the cluster's), not each worker's.
"""

from __future__ import annotations

from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.llm_engine import LLMEngine


def load(engine: LLMEngine, name: str, path: str) -> tuple[bool, list[str]]:
    """Engine thread: load adapter ``name`` from ``path`` unless the engine holds it; (whether
    it loaded now, every adapter held). ``InvalidRequestError`` naming the field for a worker
    without ``--enable-lora`` or a bad adapter (``LLMEngine.add_lora``)."""
    if engine.config.lora is None:
        raise InvalidRequestError("lora_name", "this worker runs without --enable-lora, so it holds no adapter")
    if name in engine.lora_names():
        return False, held(engine)
    engine.add_lora(name, path)
    return True, held(engine)


def unload(engine: LLMEngine, name: str) -> tuple[bool, list[str]]:
    """Engine thread: drop adapter ``name``; (whether the engine held it, every adapter held)."""
    if engine.config.lora is None:
        return False, []
    found = engine.remove_lora(name)
    return found, held(engine)


def held_fields(engine: LLMEngine) -> dict:
    """``WorkerStats``' ``lora_names`` and ``lora_fingerprints``, one snapshot of the table
    (sorted by name; the lists parallel), copied as ``held`` copies it."""
    if engine.lora is None:
        return {"lora_names": [], "lora_fingerprints": []}
    for _ in range(2):
        try:
            table = engine.lora.fingerprints()
            break
        except RuntimeError:  # the engine thread changed its table while we copied it
            continue
    else:
        table = engine.lora.fingerprints()
    names = sorted(table)
    return {"lora_names": names, "lora_fingerprints": [table[n] for n in names]}


def held(engine: LLMEngine) -> list[str]:
    """The adapters the engine holds, sorted ([] without ``--enable-lora``). Read from the
    stats poll's thread too: a copy of a name list, which a load on the engine thread may be
    changing (one retry covers a change in the middle of the copy)."""
    if engine.config.lora is None:
        return []
    for _ in range(2):
        try:
            return sorted(engine.lora_names())
        except RuntimeError:  # the engine thread changed its table while we copied it
            continue
    return sorted(engine.lora_names())
