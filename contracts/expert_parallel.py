"""Names the expert-parallel group's services share (the launcher imports them without torch)."""

# A rank worker whose expert-parallel group broke (a peer dead or hung) exits with this code; its group's ranks are
# then restarted together (EX_TEMPFAIL: try again).
EXIT_GROUP_BROKEN = 75

# Compose: the port a group's first rank listens on for its group's rendezvous, inside its own container (every
# rank is a container of its own, so one port serves every group); torch.distributed's customary port.
COMPOSE_RENDEZVOUS_PORT = 29500


def group_name(first_rank: int) -> str:
    """The name of the expert-parallel group whose first rank is the stack's rank `first_rank`: ep-<index>."""
    return f"ep-{first_rank}"


def group_first_rank(rank: int, size: int) -> int:
    """The stack's rank that leads `rank`'s group when groups of `size` consecutive ranks are formed (0..size-1 the
    first group, size..2*size-1 the next); its place in the group is rank - group_first_rank(rank, size)."""
    return rank - rank % size
