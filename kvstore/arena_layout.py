"""The arena's slot layout: fixed by the first rank that attaches, then every rank must match it.

Slot i is the byte range [i * slot_bytes, (i + 1) * slot_bytes) of the arena file and holds one physical
KV block. Blocks of a different size or of another hash namespace (another model, tokenizer or block
size) cannot share the arena: they would read each other's bytes as their own.
"""

from __future__ import annotations

from dataclasses import dataclass

# Bounds the index's memory (about 100 bytes of bookkeeping per slot) and keeps slot numbers in int32.
MAX_SLOTS = 1 << 20
MAX_NAMESPACE_BYTES = 64


class InvalidAttachError(ValueError):
    """Attach fields that no layout could accept (a malformed request)."""


class LayoutMismatchError(ValueError):
    """A well-formed Attach whose blocks do not fit this arena or its fixed layout."""


@dataclass(frozen=True)
class SlotLayout:
    """How this kvstore cuts its arena into slots, and whose blocks they hold (a rank learns it, with the
    arena's id and path, as rank_worker.l1.arena.ArenaLayout)."""

    slot_bytes: int
    hash_namespace: bytes
    num_slots: int


def plan_layout(
    arena_bytes: int, slot_bytes: int, hash_namespace: bytes, max_slots: int = MAX_SLOTS
) -> tuple[SlotLayout, str]:
    """The layout the first Attach fixes, and a note when slots are capped at max_slots (else empty).
    Raises LayoutMismatchError when not even one slot fits."""
    check_attach_fields(slot_bytes, hash_namespace)
    num_slots = arena_bytes // slot_bytes
    if num_slots < 1:
        raise LayoutMismatchError(f"a slot of {slot_bytes} bytes does not fit the {arena_bytes}-byte arena")
    note = ""
    if num_slots > max_slots:
        note = f"{num_slots} slots of {slot_bytes} bytes fit; using the first {max_slots}"
        num_slots = max_slots
    return SlotLayout(slot_bytes=slot_bytes, hash_namespace=hash_namespace, num_slots=num_slots), note


def check_layout(layout: SlotLayout, slot_bytes: int, hash_namespace: bytes) -> None:
    """Raise LayoutMismatchError unless a rank with these blocks may use the arena laid out as `layout`."""
    check_attach_fields(slot_bytes, hash_namespace)
    if slot_bytes != layout.slot_bytes:
        raise LayoutMismatchError(
            f"slot_bytes {slot_bytes} differs from the arena's {layout.slot_bytes}, fixed by the first rank that "
            "attached: every rank of a kvstore must use the same model, dtype and block_size"
        )
    if hash_namespace != layout.hash_namespace:
        raise LayoutMismatchError(
            f"hash_namespace {hash_namespace.hex()} differs from the arena's {layout.hash_namespace.hex()}, fixed "
            "by the first rank that attached: every rank of a kvstore must serve the same model and tokenizer"
        )


def check_attach_fields(slot_bytes: int, hash_namespace: bytes) -> None:
    """Raise InvalidAttachError for a non-positive slot size or an empty or oversized namespace."""
    if slot_bytes <= 0:
        raise InvalidAttachError("slot_bytes must be positive")
    if not 0 < len(hash_namespace) <= MAX_NAMESPACE_BYTES:
        raise InvalidAttachError(f"hash_namespace must be 1 to {MAX_NAMESPACE_BYTES} bytes, got {len(hash_namespace)}")
