"""The router (rank registry, prefix index, sessions): a later issue."""
