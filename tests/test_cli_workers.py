"""`pdserve workers` against a scripted AdminService: rows in pool and index order, epochs
in one width, and the planner's last decision when the server runs one."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdserve.v1 import admin_pb2 as pb
from pdserve.v1 import admin_pb2_grpc as pb_grpc
from router.cli.main import main


def worker(
    pool: str, index: int, epoch: str, gpu_ids: tuple[int, ...] = ()
) -> pb.WorkerDescription:
    return pb.WorkerDescription(
        worker_id=f"{pool}-{index}",
        pool=pool,
        index=index,
        state=pb.WORKER_STATE_LIVE,
        epoch=epoch,
        device="cuda" if gpu_ids else "cpu",
        node_ip="127.0.0.1",
        tensor_parallel_size=max(len(gpu_ids), 1),
        gpu_ids=list(gpu_ids),
    )


class ScriptedAdmin(pb_grpc.AdminServiceServicer):
    """Lists workers in the order a router's restarts and scaling can leave them."""

    def __init__(self, planner: pb.PlannerStatus | None = None) -> None:
        self.planner = planner
        self.migrations: list[pb.MigrateRequestsRequest] = []

    async def MigrateRequests(
        self, request: pb.MigrateRequestsRequest, context: grpc.aio.ServicerContext
    ) -> pb.MigrateRequestsResponse:
        self.migrations.append(request)
        return pb.MigrateRequestsResponse(num_candidates=3, moved_with_kv=2, moved_by_recompute=1)

    async def ListWorkers(
        self, request: pb.ListWorkersRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListWorkersResponse:
        return pb.ListWorkersResponse(
            planner=self.planner,
            workers=[
                worker("decode", 10, "3b"),
                worker("prefill", 1, "2f0c41d9e8a7b6c5", gpu_ids=(2, 3)),
                worker("decode", 2, "1a2b3c4d5e6f7a8"),
                worker("prefill", 0, "9"),
                worker("decode", 0, "3c0ffee15badd00d"),
            ],
        )


def run_workers_cli(
    planner: pb.PlannerStatus | None = None,
    command: tuple[str, ...] = ("workers",),
    admin: ScriptedAdmin | None = None,
) -> int:
    """`pdserve workers` (or another admin command) in-process against a ScriptedAdmin;
    its exit status."""

    async def body() -> int:
        server = grpc.aio.server()
        pb_grpc.add_AdminServiceServicer_to_server(admin or ScriptedAdmin(planner), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            argv = [command[0], "--server", f"127.0.0.1:{port}", *command[1:]]
            return await asyncio.get_running_loop().run_in_executor(None, main, argv)
        finally:
            await server.stop(0)

    return asyncio.run(body())


def test_workers_are_listed_by_pool_then_index_with_fixed_width_epochs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert run_workers_cli() == 0
    header, *rows = capsys.readouterr().out.strip().splitlines()
    assert header.split()[:3] == ["worker", "state", "epoch"]
    ids = [row.split()[0] for row in rows]
    assert ids == ["prefill-0", "prefill-1", "decode-0", "decode-2", "decode-10"]
    epochs = [row.split()[2] for row in rows]
    assert epochs == [
        "0000000000000009",
        "2f0c41d9e8a7b6c5",
        "3c0ffee15badd00d",
        "01a2b3c4d5e6f7a8",
        "000000000000003b",
    ]
    starts = {row.index(epoch) for row, epoch in zip(rows, epochs, strict=True)}
    assert len(starts) == 1  # one column
    # Each worker's tensor-parallel size and GPUs (a tensor-parallel prefill worker).
    tp_column = header.split().index("tp") - 1  # "in flight" is two words in the header
    assert [row.split()[tp_column : tp_column + 2] for row in rows[:2]] == [
        ["1", "-"],
        ["2", "2,3"],
    ]


def test_the_planners_last_decision_follows_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    planner = pb.PlannerStatus(
        max_workers=4,
        interval_seconds=10,
        seconds_since_decision=3.2,
        traffic="2.10 req/s over 30 s, output 38 tokens",
        pools=[
            pb.PlannerPoolDecision(
                pool="prefill", current=1, target=2, action="scale_up",
                reason="capacity_short", load_workers=1.4, detail="load 1.40 workers",
            ),
            pb.PlannerPoolDecision(
                pool="decode", current=1, target=1, action="hold",
                reason="within_slo", load_workers=0.3, detail="load 0.30 workers",
            ),
        ],
    )  # fmt: skip
    assert run_workers_cli(planner) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-3:] == [
        "planner: budget 4 workers, every 10 s; last decision 3 s ago: "
        "2.10 req/s over 30 s, output 38 tokens",
        "  prefill 1 -> 2: scale_up (capacity_short); load 1.40 workers",
        "  decode 1: hold (within_slo); load 0.30 workers",
    ]


def test_without_a_planner_only_the_workers_are_listed(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_workers_cli() == 0
    assert "planner" not in capsys.readouterr().out


def test_scale_migrate_asks_to_move_requests_and_says_how_many_moved(
    capsys: pytest.CaptureFixture[str],
) -> None:
    admin = ScriptedAdmin()
    command = ("scale", "--migrate", "decode-0", "--max-requests", "3")
    assert run_workers_cli(command=command, admin=admin) == 0
    assert [(m.worker_id, m.max_requests) for m in admin.migrations] == [("decode-0", 3)]
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "decode-0: 2 of 3 requests moved with their KV, 1 by recompute"
    assert out[1].split() == [
        "worker", "state", "epoch", "in", "flight", "device", "tp", "gpus", "node", "peers"
    ]  # fmt: skip
