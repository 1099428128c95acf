"""The stack's topology: the same services, dependencies, health checks and secrets in local and compose mode;
local addresses, ports, GPU pinning and the CPU memory split; the start tiers."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from contracts.address import split_host_port
from contracts.config import KvServeConfig
from launcher.topology import (
    COMPOSE_METRICS_PORT,
    INTERNAL_SECRET,
    REDIS_PASSWORD,
    ServiceSpec,
    StackPlan,
    build_topology,
    start_tiers,
)

ROOT = Path(__file__).resolve().parents[2]


def config(**values: object) -> KvServeConfig:
    return KvServeConfig(**values)  # type: ignore[arg-type]


STATE_DIR = Path("/var/kvserve/run")


def local(ranks: int, gpu_ids: tuple[str, ...] = (), **values: object) -> list[ServiceSpec]:
    plan = StackPlan(
        mode="local", config_file="/etc/kv.yaml", python="/venv/bin/python", state_dir=STATE_DIR, gpu_ids=gpu_ids
    )
    return build_topology(config(**values), ranks, plan)


def compose(ranks: int, **values: object) -> list[ServiceSpec]:
    return build_topology(config(**values), ranks, StackPlan(mode="compose"))


def by_name(specs: list[ServiceSpec]) -> dict[str, ServiceSpec]:
    return {spec.name: spec for spec in specs}


def shape(spec: ServiceSpec) -> tuple[object, ...]:
    """What must not differ between the local stack and the compose stack."""
    return (
        spec.name,
        spec.role,
        spec.depends_on,
        spec.health.kind,
        spec.published,
        spec.restart,
        spec.reads_config,
        spec.uses_arena,
        spec.gpu,
        spec.secrets,
    )


def test_local_and_compose_describe_the_same_stack() -> None:
    gpus = ("0", "1", "2", "3")
    assert [shape(spec) for spec in local(4, gpus)] == [shape(spec) for spec in compose(4)]
    names = [spec.name for spec in compose(4)]
    assert names == ["redis", "kvstore", "router", *(f"rank-worker-{i}" for i in range(4)), "gateway"]
    # the same program and flags in both modes; only the interpreter, binds, ports and file paths differ
    for local_spec, compose_spec in zip(local(4, gpus), compose(4), strict=True):
        if local_spec.reads_config:
            assert local_spec.argv[1:3] == compose_spec.argv[1:3]  # -m <module>
        else:
            assert local_spec.argv[0] == compose_spec.argv[0] == "redis-server"
        flags = [[word for word in spec.argv if word.startswith("--")] for spec in (local_spec, compose_spec)]
        assert flags[0] == flags[1], local_spec.name
        assert set(local_spec.environment) == set(compose_spec.environment)


def test_dependencies_give_the_start_order() -> None:
    tiers = [[spec.name for spec in tier] for tier in start_tiers(compose(2))]
    assert tiers == [["redis", "kvstore"], ["router"], ["rank-worker-0", "rank-worker-1"], ["gateway"]]
    gateway = by_name(compose(2))["gateway"]
    assert gateway.depends_on == ("router", "rank-worker-0", "rank-worker-1")


def test_start_tiers_refuse_cycles_and_unknown_services() -> None:
    specs = compose(1)
    redis = specs[0]
    cyclic = [replace(redis, depends_on=("gateway",)), *specs[1:]]
    with pytest.raises(ValueError, match="cycle"):
        start_tiers(cyclic)
    with pytest.raises(ValueError, match="unknown services"):
        start_tiers([replace(redis, depends_on=("postgres",))])


def test_local_mode_binds_loopback_on_configured_ports_and_wires_addresses() -> None:
    specs = by_name(
        local(
            2,
            kvstore_port=7001,
            router_port=7002,
            rank_worker_port=7010,
            gateway_port=7080,
            redis_url="redis://127.0.0.1:7379/3",
        )
    )
    assert specs["redis"].argv[:6] == (
        "redis-server",
        str(STATE_DIR / "redis-auth.conf"),  # requirepass: the password is in no argv
        "--port",
        "7379",
        "--bind",
        "127.0.0.1",
    )
    assert "--appendonly" in specs["redis"].argv
    assert specs["kvstore"].argv == ("/venv/bin/python", "-m", "kvstore", "--host", "127.0.0.1", "--port", "7001")
    router = specs["router"]
    assert router.environment["KVSERVE_REDIS_URL"] == "redis://127.0.0.1:7379/3"
    assert router.environment["KVSERVE_KVSTORE"] == "127.0.0.1:7001"
    for rank in range(2):
        spec = specs[f"rank-worker-{rank}"]
        assert spec.port == 7010 + rank  # consecutive ports on one machine
        assert spec.argv[-2:] == ("--rank-id", f"rank-{rank}")
        assert spec.environment["KVSERVE_RANK_ADVERTISE_ADDRESS"] == f"127.0.0.1:{7010 + rank}"
        assert spec.environment["KVSERVE_ROUTER"] == "127.0.0.1:7002"
        assert spec.environment["KVSERVE_KVSTORE"] == "127.0.0.1:7001"
    gateway = specs["gateway"]
    assert gateway.environment["KVSERVE_ROUTER"] == "127.0.0.1:7002"
    assert json.loads(gateway.environment["KVSERVE_RANK_WORKERS"]) == ["127.0.0.1:7010", "127.0.0.1:7011"]
    assert gateway.health.target == "http://127.0.0.1:7080/ready"
    assert all(spec.environment.get("KVSERVE_CONFIG") == "/etc/kv.yaml" for spec in specs.values() if spec.reads_config)
    assert all(spec.host == "127.0.0.1" for spec in specs.values())


def test_every_service_reads_its_secrets_from_files() -> None:
    """The internal secret for every kvserve service, Redis's password for Redis and the router: paths in the
    state dir locally, compose secrets in compose; never a value in an argv or the environment."""
    for specs, internal, password in (
        (local(2), str(STATE_DIR / "internal-secret"), str(STATE_DIR / "redis-password")),
        (compose(2), "/run/secrets/kvserve_internal_secret", "/run/secrets/kvserve_redis_password"),
    ):
        named = by_name(specs)
        for spec in specs:
            if spec.reads_config:
                assert spec.environment["KVSERVE_INTERNAL_SECRET_FILE"] == internal, spec.name
                assert INTERNAL_SECRET in spec.secrets, spec.name
        assert named["router"].environment["KVSERVE_REDIS_PASSWORD_FILE"] == password
        assert named["router"].secrets == (INTERNAL_SECRET, REDIS_PASSWORD)
        assert named["redis"].secrets == (REDIS_PASSWORD,)
        assert named["redis"].health.password_file == password  # the probe AUTHs as the router does
        assert not any("requirepass" in word for spec in specs for word in spec.argv)
    assert by_name(local(1))["redis"].entrypoint == ()  # locally `kvserve up` writes the config file itself
    entrypoint = by_name(compose(1))["redis"].entrypoint
    assert entrypoint[:2] == ("sh", "-c") and "/run/secrets/kvserve_redis_password" in entrypoint[2]


def test_compose_mode_uses_service_names_and_binds_all_interfaces() -> None:
    specs = by_name(compose(2))
    assert all(spec.host == "0.0.0.0" for spec in specs.values())
    assert specs["router"].environment["KVSERVE_REDIS_URL"] == "redis://redis:6379/0"
    rank = specs["rank-worker-1"]
    assert rank.environment["KVSERVE_RANK_ADVERTISE_ADDRESS"] == "rank-worker-1:50151"
    assert rank.environment["CUDA_VISIBLE_DEVICES"] == "0"  # its one reserved GPU, seen from inside
    assert rank.gpu == "1"
    # health checks run inside the service's own container
    assert specs["kvstore"].health.target == "127.0.0.1:50141"


def test_port_zero_picks_distinct_free_ports() -> None:
    specs = local(3, kvstore_port=0, router_port=0, rank_worker_port=0, gateway_port=0, redis_url="redis://h:0/0")
    ports = [spec.port for spec in specs]
    assert 0 not in ports and len(set(ports)) == len(ports)


def test_port_zero_never_gives_two_services_one_port(monkeypatch: pytest.MonkeyPatch) -> None:
    """The OS may report a port free twice (nothing holds it between the picks): the build asks again."""
    reported = iter([41001, 41001, 41002, 41001, 41002, 41003, 41004, 41004, 41005, 41006, 41007])
    monkeypatch.setattr("launcher.topology.free_port", lambda host="127.0.0.1": next(reported))
    specs = local(3, kvstore_port=0, router_port=0, rank_worker_port=0, gateway_port=0, redis_url="redis://h:0/0")
    assert sorted(spec.port for spec in specs) == [41001, 41002, 41003, 41004, 41005, 41006, 41007]


def test_gpus_are_pinned_one_per_rank() -> None:
    specs = local(2, ("2", "3"))
    ranks = [spec for spec in specs if spec.role == "rank-worker"]
    assert [rank.environment["CUDA_VISIBLE_DEVICES"] for rank in ranks] == ["2", "3"]
    assert all("KVSERVE_KV_CACHE_MEMORY_GB" not in rank.environment for rank in ranks)
    with pytest.raises(ValueError, match="need 3 GPUs"):
        local(3, ("0", "1"))


def test_ranks_sharing_a_gpu_split_its_memory() -> None:
    specs = local(3, ("0", "0", "1"), gpu_memory_utilization=0.9)
    ranks = [spec for spec in specs if spec.role == "rank-worker"]
    assert [rank.environment["CUDA_VISIBLE_DEVICES"] for rank in ranks] == ["0", "0", "1"]
    shares = [rank.environment.get("KVSERVE_GPU_MEMORY_UTILIZATION") for rank in ranks]
    assert shares == ["0.45", "0.45", None]  # the rank alone on GPU 1 keeps the configured share


def test_cpu_ranks_split_the_kv_cache_budget() -> None:
    ranks = [spec for spec in local(4, kv_cache_memory_gb=3.0) if spec.role == "rank-worker"]
    assert {rank.environment["KVSERVE_KV_CACHE_MEMORY_GB"] for rank in ranks} == {"0.75"}
    assert all("CUDA_VISIBLE_DEVICES" not in rank.environment for rank in ranks)
    single = [spec for spec in local(1, kv_cache_memory_gb=3.0) if spec.role == "rank-worker"]
    assert "KVSERVE_KV_CACHE_MEMORY_GB" not in single[0].environment  # one rank keeps the configured size
    fixed = [spec for spec in local(2, num_kv_blocks=64) if spec.role == "rank-worker"]
    assert "KVSERVE_KV_CACHE_MEMORY_GB" not in fixed[0].environment  # a fixed pool size is left alone


def test_kvstore_leaves_ram_for_cpu_ranks() -> None:
    kvstore = by_name(local(2, kv_cache_memory_gb=3.0, l1_headroom_gb=4.0))["kvstore"]
    assert kvstore.environment["KVSERVE_L1_HEADROOM_GB"] == "7"  # its own headroom + the ranks' KV pools
    on_gpus = by_name(local(2, ("0", "1"), kv_cache_memory_gb=3.0))["kvstore"]
    assert "KVSERVE_L1_HEADROOM_GB" not in on_gpus.environment  # GPU ranks keep their KV on the GPU
    assert "KVSERVE_L1_HEADROOM_GB" not in by_name(compose(2))["kvstore"].environment


def test_a_stack_needs_a_rank() -> None:
    with pytest.raises(ValueError, match="at least one"):
        compose(0)


def test_up_places_ranks_on_the_gpus_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from contracts.config import KvServeConfig
    from launcher.up import StackError, UpOptions, plan_stack

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    config = KvServeConfig(
        rank_worker_port=0, router_port=0, kvstore_port=0, gateway_port=0, redis_url="redis://127.0.0.1:0/0"
    )
    specs = plan_stack(UpOptions(None, ranks=2, gpus=("1", "1")), config)
    ranks = [spec for spec in specs if spec.role == "rank-worker"]
    assert [rank.gpu for rank in ranks] == ["1", "1"]
    assert {rank.environment["KVSERVE_GPU_MEMORY_UTILIZATION"] for rank in ranks} == {"0.45"}
    with pytest.raises(StackError, match="one per rank"):
        plan_stack(UpOptions(None, ranks=2, gpus=("0",)), config)
    with pytest.raises(StackError, match="GPU 7 is not visible"):
        plan_stack(UpOptions(None, ranks=2, gpus=("7", "7")), config)


EP_ENV = (
    "KVSERVE_EXPERT_PARALLEL_SIZE",
    "KVSERVE_EXPERT_PARALLEL_RANK",
    "KVSERVE_EXPERT_PARALLEL_GROUP",
    "KVSERVE_EXPERT_PARALLEL_RENDEZVOUS",
)


def rank_specs(specs: list[ServiceSpec]) -> list[ServiceSpec]:
    return [spec for spec in specs if spec.role == "rank-worker"]


def expert_parallel_env(spec: ServiceSpec) -> tuple[str, ...]:
    return tuple(spec.environment.get(name, "") for name in EP_ENV)


def test_expert_parallel_groups_locally_meet_at_a_port_of_their_own() -> None:
    """--ranks 4 --expert-parallel 2: ranks 0-1 are group ep-0, 2-3 group ep-2; each group's first rank listens
    on a loopback port no other service of the build has."""
    plan = StackPlan(mode="local", config_file="/etc/kv.yaml", python="/venv/bin/python", state_dir=STATE_DIR)
    specs = build_topology(config(), 4, plan, expert_parallel=2)
    ranks = rank_specs(specs)
    places = [expert_parallel_env(rank)[:3] for rank in ranks]
    assert places == [("2", "0", "ep-0"), ("2", "1", "ep-0"), ("2", "0", "ep-2"), ("2", "1", "ep-2")]
    assert [rank.group for rank in ranks] == ["ep-0", "ep-0", "ep-2", "ep-2"]
    rendezvous = [rank.environment["KVSERVE_EXPERT_PARALLEL_RENDEZVOUS"] for rank in ranks]
    assert rendezvous[0] == rendezvous[1] and rendezvous[2] == rendezvous[3] and rendezvous[0] != rendezvous[2]
    hosts, ports = zip(*(split_host_port(address) for address in rendezvous[::2]), strict=True)
    assert set(hosts) == {"127.0.0.1"}
    taken = {spec.port for spec in specs}
    assert not taken & set(ports), "a rendezvous port is another service's"
    assert all(not spec.group for spec in specs if spec.role != "rank-worker")
    # the rest of a rank's wiring is as without groups
    plain = rank_specs(build_topology(config(), 4, plan))
    for grouped, alone in zip(ranks, plain, strict=True):
        assert {k: v for k, v in grouped.environment.items() if k not in EP_ENV} == alone.environment
        assert (grouped.argv, grouped.port, grouped.depends_on) == (alone.argv, alone.port, alone.depends_on)


def test_expert_parallel_rendezvous_ports_avoid_configured_ports(monkeypatch: pytest.MonkeyPatch) -> None:
    """The OS reports a configured port free until its service starts: a rendezvous pick must skip it."""
    reported = iter([50152, 8080, 6379, 50140, 41000, 41001])
    monkeypatch.setattr("launcher.topology.free_port", lambda host="127.0.0.1": next(reported))
    ranks = rank_specs(local(4, rank_worker_port=50151, gateway_port=8080, router_port=50140, expert_parallel_size=2))
    rendezvous = [rank.environment["KVSERVE_EXPERT_PARALLEL_RENDEZVOUS"] for rank in ranks]
    assert rendezvous == ["127.0.0.1:41000", "127.0.0.1:41000", "127.0.0.1:41001", "127.0.0.1:41001"]


def test_expert_parallel_groups_in_compose_meet_at_their_first_ranks_container() -> None:
    specs = build_topology(config(), 4, StackPlan(mode="compose"), expert_parallel=2)
    ranks = rank_specs(specs)
    assert [expert_parallel_env(rank) for rank in ranks] == [
        ("2", "0", "ep-0", "rank-worker-0:29500"),
        ("2", "1", "ep-0", "rank-worker-0:29500"),
        ("2", "0", "ep-2", "rank-worker-2:29500"),
        ("2", "1", "ep-2", "rank-worker-2:29500"),
    ]
    # nothing new to wait for: a group's ranks meet with retries, and their service names resolve on the network
    plain = by_name(compose(4))
    assert all(spec.depends_on == plain[spec.name].depends_on for spec in specs)
    gpus = ("0", "1", "2", "3")
    local_ranks = rank_specs(
        build_topology(config(), 4, StackPlan(mode="local", config_file="/k.yaml", gpu_ids=gpus), expert_parallel=2)
    )
    assert [set(spec.environment) for spec in local_ranks] == [set(spec.environment) for spec in ranks]
    assert [spec.group for spec in local_ranks] == [spec.group for spec in ranks]


def test_two_ranks_in_one_group() -> None:
    for specs in (local(2, expert_parallel_size=2), compose(2, expert_parallel_size=2)):
        ranks = rank_specs(specs)
        assert [expert_parallel_env(rank)[:3] for rank in ranks] == [("2", "0", "ep-0"), ("2", "1", "ep-0")]
        assert len({rank.environment["KVSERVE_EXPERT_PARALLEL_RENDEZVOUS"] for rank in ranks}) == 1
    assert (
        rank_specs(compose(2, expert_parallel_size=2))[1].environment["KVSERVE_EXPERT_PARALLEL_RENDEZVOUS"]
        == "rank-worker-0:29500"
    )


def test_a_group_size_must_divide_the_ranks() -> None:
    with pytest.raises(ValueError, match="must divide the number of ranks"):
        build_topology(config(), 3, StackPlan(mode="compose"), expert_parallel=2)
    with pytest.raises(ValueError, match="must divide the number of ranks"):
        compose(2, expert_parallel_size=4)  # the config's size is the default
    with pytest.raises(ValueError, match="at least one rank"):
        build_topology(config(), 2, StackPlan(mode="compose"), expert_parallel=0)


def test_without_groups_the_ranks_are_told_nothing_new() -> None:
    """One rank per group (the default) leaves every spec as it was; --expert-parallel 1 over a config asking
    for groups tells the ranks so."""
    for specs in (local(4), compose(4), build_topology(config(), 4, StackPlan(mode="compose"), expert_parallel=1)):
        assert all(not set(EP_ENV) & set(spec.environment) and not spec.group for spec in specs)
    assert compose(4) == build_topology(config(), 4, StackPlan(mode="compose"), expert_parallel=1)
    overridden = build_topology(config(expert_parallel_size=2), 2, StackPlan(mode="compose"), expert_parallel=1)
    assert [expert_parallel_env(rank) for rank in rank_specs(overridden)] == [("1", "", "", "")] * 2


def test_up_plans_expert_parallel_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    from launcher.up import UpOptions, plan_stack

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    config = KvServeConfig(
        rank_worker_port=0, router_port=0, kvstore_port=0, gateway_port=0, redis_url="redis://127.0.0.1:0/0"
    )
    specs = plan_stack(UpOptions(None, ranks=4, expert_parallel=2), config)
    assert [rank.group for rank in rank_specs(specs)] == ["ep-0", "ep-0", "ep-2", "ep-2"]
    assert [rank.gpu for rank in rank_specs(specs)] == ["0", "1", "2", "3"]  # a GPU each, as without groups


def test_every_grpc_service_gets_a_metrics_port() -> None:
    """Locally the configured ports (ranks: consecutive from rank_worker_metrics_port), 0 = off; compose:
    COMPOSE_METRICS_PORT in every container unless configured; the gateway serves /metrics on its own port."""
    grpc_services = ("kvstore", "router", "rank-worker-0", "rank-worker-1")
    off = by_name(local(2))
    assert all(off[name].metrics_port == 0 for name in grpc_services)
    assert off["router"].environment["KVSERVE_ROUTER_METRICS_PORT"] == "0"

    specs = by_name(local(2, kvstore_metrics_port=9461, router_metrics_port=9462, rank_worker_metrics_port=9470))
    assert [specs[name].metrics_port for name in grpc_services] == [9461, 9462, 9470, 9471]
    assert specs["router"].environment["KVSERVE_ROUTER_METRICS_PORT"] == "9462"
    assert specs["kvstore"].environment["KVSERVE_KVSTORE_METRICS_PORT"] == "9461"
    assert specs["rank-worker-1"].environment["KVSERVE_RANK_WORKER_METRICS_PORT"] == "9471"
    assert specs["gateway"].metrics_port == 0

    in_compose = by_name(compose(2))
    assert {in_compose[name].metrics_port for name in grpc_services} == {COMPOSE_METRICS_PORT}
    assert in_compose["rank-worker-1"].environment["KVSERVE_RANK_WORKER_METRICS_PORT"] == str(COMPOSE_METRICS_PORT)


def test_each_local_rank_gets_its_own_kv_event_ports() -> None:
    values = {"kv_events_endpoint": "tcp://127.0.0.1:5557", "kv_events_replay_endpoint": "tcp://127.0.0.1:5558"}
    specs = by_name(local(3, **values))
    seen = set()
    for rank in range(3):
        environment = specs[f"rank-worker-{rank}"].environment
        # rank 0 reads the config's own endpoints; the others get theirs in the environment
        endpoint = environment.get("KVSERVE_KV_EVENTS_ENDPOINT", values["kv_events_endpoint"])
        replay = environment.get("KVSERVE_KV_EVENTS_REPLAY_ENDPOINT", values["kv_events_replay_endpoint"])
        assert endpoint == f"tcp://127.0.0.1:{5557 + 2 * rank}" and replay == f"tcp://127.0.0.1:{5558 + 2 * rank}"
        seen.update((endpoint, replay))
    assert len(seen) == 6
    # in compose every rank is a container of its own: the same ports, from the config file
    assert all("KVSERVE_KV_EVENTS_ENDPOINT" not in spec.environment for spec in compose(2, **values))
