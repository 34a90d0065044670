"""The simulation engine's dispatch loop: same messages as Flower's, one scan instead of one per node.

Uses Flower's own in-memory LinkState, node registration and InMemoryGrid, set up as
``flwr.simulation.run_simulation`` does.
"""

from __future__ import annotations

import threading
from queue import Queue

import pytest
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.proto.task_pb2 import Task
from flwr.server.superlink.fleet.vce import vce_api
from flwr.server.superlink.linkstate import LinkStateFactory
from flwr.server.superlink.linkstate.in_memory_linkstate import RunRecord
from flwr.supercore.constant import FLWR_IN_MEMORY_DB_NAME, NOOP_FEDERATION_ID
from flwr.supercore.object_store import ObjectStoreFactory
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity
from flwr.superlink.federation import NoOpFederationManager
from flwr.superlink.grid.inmemory_grid import InMemoryGrid

from simulations import vce_dispatch

NUM_NODES = 2000


@pytest.fixture
def federation(monkeypatch):
    factory = LinkStateFactory(FLWR_IN_MEMORY_DB_NAME, NoOpFederationManager(), ObjectStoreFactory())
    state = factory.state()
    run = Run.create_empty(run_id=7)
    run.primary_task_id = 11
    run.federation_id = NOOP_FEDERATION_ID
    state.run_ids[run.run_id] = RunRecord(run=run)
    state.task_store[run.primary_task_id] = Task(task_id=run.primary_task_id, run_id=run.run_id)
    # What run_simulation sets for the process (Message() reads it); restored after the test.
    for name, value in (("_task_id", 1), ("_run_id", run.run_id), ("_node_id", SUPERLINK_NODE_ID)):
        monkeypatch.setattr(TaskIdentity, name, value)
    nodes = vce_api._register_nodes(NUM_NODES, factory)
    grid = InMemoryGrid(state_factory=factory)
    grid.set_run(run)
    return state, grid, nodes


def _push(grid, node_ids, tag: str) -> None:
    grid.push_messages(
        [Message(RecordDict({"config": ConfigRecord({"tag": tag})}), node_id, "train") for node_id in node_ids]
    )


def _drain(queue: Queue) -> list[tuple[int, str]]:
    out = []
    while not queue.empty():
        msg = queue.get()
        out.append((msg.metadata.dst_node_id, msg.content.config_records["config"]["tag"]))
    return out


def test_one_pass_hands_each_node_its_first_message_without_a_per_node_query(federation, monkeypatch):
    state, grid, nodes = federation
    node_ids = sorted(nodes)
    sampled = node_ids[::20]  # 100 of 2000
    _push(grid, sampled, "a")
    _push(grid, sampled[:3], "b")  # a second message for three nodes: it waits for the next pass

    def per_node_query(*args, **kwargs):
        raise AssertionError("dispatch_once must not query nodes one by one")

    monkeypatch.setattr(state, "get_message_ins", per_node_query)
    queue: Queue = Queue()
    assert vce_dispatch.dispatch_once(state, queue, nodes) == len(sampled)
    assert sorted(_drain(queue)) == sorted((n, "a") for n in sampled)
    assert vce_dispatch.dispatch_once(state, queue, nodes) == 3
    assert sorted(_drain(queue)) == sorted((n, "b") for n in sampled[:3])
    assert vce_dispatch.dispatch_once(state, queue, nodes) == 0  # everything delivered once


def test_same_deliveries_as_flowers_loop(federation):
    state, grid, nodes = federation
    node_ids = sorted(nodes)
    _push(grid, node_ids[:5], "first")
    _push(grid, node_ids[2:4], "second")
    # Flower's loop, one pass (the stop event is set once it waits): the reference.
    reference: Queue = Queue()
    stop = threading.Event()
    real_wait = stop.wait
    stop.wait = lambda timeout=None: stop.set() or real_wait(0)  # type: ignore[method-assign]
    vce_api.add_messages_to_queue(state, reference, nodes, stop)
    expected = sorted(_drain(reference))
    # Reset what that pass marked and run ours on the same store.
    for msg in state.message_ins_store.values():
        msg.metadata.delivered_at = ""
    ours: Queue = Queue()
    vce_dispatch.dispatch_once(state, ours, nodes)
    assert sorted(_drain(ours)) == expected
    assert expected == sorted([(n, "first") for n in node_ids[:5]])


def test_expired_messages_are_dropped_not_delivered(federation):
    state, grid, nodes = federation
    node_ids = sorted(nodes)
    _push(grid, node_ids[:2], "x")
    expired = next(iter(state.message_ins_store.values()))
    expired.metadata.__dict__["_created_at"] = expired.metadata.created_at - 10 * expired.metadata.ttl
    queue: Queue = Queue()
    assert vce_dispatch.dispatch_once(state, queue, nodes) == 1
    assert expired.metadata.message_id not in state.message_ins_store


def test_install_replaces_flowers_loop_once_and_only_where_the_engine_runs(monkeypatch):
    current = vce_api.add_messages_to_queue  # importing simulations.client_app may have installed it already
    original = getattr(current, "flower_loop", current)
    monkeypatch.setattr(vce_api, "add_messages_to_queue", original)  # restored after the test
    assert vce_dispatch.install()
    patched = vce_api.add_messages_to_queue
    assert patched.fedquant_dispatch and patched.flower_loop is original
    assert vce_dispatch.install() and vce_api.add_messages_to_queue is patched
    vce_dispatch.uninstall()
    assert vce_api.add_messages_to_queue is original
    monkeypatch.delitem(__import__("sys").modules, vce_dispatch._VCE_API)
    assert not vce_dispatch.install()
