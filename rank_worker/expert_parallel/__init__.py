"""Expert parallelism: a MoE model's routed experts split across the ranks of a group (one rank per GPU), each
rank keeping its own sessions, scheduler and KV pool; the MoE layers exchange tokens across the group."""
