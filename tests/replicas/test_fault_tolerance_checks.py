"""fault_tolerance="torchft" refuses what cannot work before training, with the value and the fix."""

from __future__ import annotations

import socket
import sys
from types import SimpleNamespace

import pytest
import torch

from lit_efficient import PACIStrategy
from lit_efficient.replicas.fault_tolerance import (
    TorchftReplicas,
    _timeout_from_env,
    group_settings,
    lighthouse_address,
    require_torchft,
)
from lit_efficient.strategy.fault_tolerant import Joining, heal, sync_settings
from tests.support.gpt_runs import gpt_model, gpt_trainer, text_data


def test_needs_an_outer_sync():
    with pytest.raises(ValueError, match="local_sgd_steps=H"):
        PACIStrategy(fault_tolerance="torchft")


def test_refuses_a_sharded_optimizer_state():
    # A healing rank takes its stage's whole optimizer state from one peer; LocalSGD/DiLoCo refuses sharding anyway.
    with pytest.raises(ValueError, match="shard_optimizer_state=True with local_sgd_steps=4"):
        PACIStrategy(fault_tolerance="torchft", local_sgd_steps=4, shard_optimizer_state=True)


def test_streaming_needs_an_outer_sync():
    with pytest.raises(ValueError, match="streaming_sync=True staggers the stages' LocalSGD/DiLoCo syncs"):
        PACIStrategy(streaming_sync=True)


def test_refuses_an_unknown_kind():
    with pytest.raises(ValueError, match="fault_tolerance='torchelastic' must be None or 'torchft'"):
        PACIStrategy(fault_tolerance="torchelastic", local_sgd_steps=4)


def test_group_index_and_count(monkeypatch):
    monkeypatch.delenv("REPLICA_GROUP_ID", raising=False)
    monkeypatch.delenv("NUM_REPLICA_GROUPS", raising=False)
    with pytest.raises(ValueError, match="set REPLICA_GROUP_ID=0, 1, ..."):
        group_settings(None, 2, 1)
    monkeypatch.setenv("REPLICA_GROUP_ID", "1")
    monkeypatch.setenv("NUM_REPLICA_GROUPS", "3")
    assert group_settings(None, None, 2) == (1, 3)
    monkeypatch.delenv("NUM_REPLICA_GROUPS")
    with pytest.raises(ValueError, match="needs the number of replica groups launched"):
        group_settings(None, None, 1)  # a guess would give the groups different shards
    with pytest.raises(ValueError, match="replica_group_id=2 is not one of the 2 replica groups"):
        group_settings(2, 2, 1)
    with pytest.raises(ValueError, match="min_replica_groups=3 must be between 1 and the 2 replica groups"):
        group_settings(0, 2, 3)
    monkeypatch.setenv("REPLICA_GROUP_ID", "first")  # int() said "invalid literal", naming no variable
    with pytest.raises(ValueError, match="REPLICA_GROUP_ID='first' must be an integer"):
        group_settings(None, 2, 1)


def test_an_unreachable_lighthouse_names_the_address_and_how_to_start_one(monkeypatch):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", f"http://127.0.0.1:{port}")
    # Started on the port it was looked for at (the message named 29510 whatever the address).
    with pytest.raises(ConnectionError, match=rf"lighthouse at http://127.0.0.1:{port} .* torchft_lighthouse --min.*"
                       rf"--bind \[::\]:{port}$"):  # fmt: skip
        lighthouse_address(timeout=1.0)
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE")
    with pytest.raises(ValueError, match="needs the lighthouse's address in TORCHFT_LIGHTHOUSE"):
        lighthouse_address()


def _serve(page: bytes):
    """A local HTTP server answering every GET with ``page``; its port."""
    import http.server
    import threading

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            self.send_response(200)
            self.end_headers()
            self.wfile.write(page)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_a_lighthouse_address_without_its_scheme_reaches_torchft_with_it(monkeypatch, recwarn):
    """``host:port`` passed the probe, then torchft refused it a minute later ("scheme is missing")."""
    server = _serve(b"<head><title>Lighthouse Dashboard - torchft</title></head>")  # what a lighthouse serves
    try:
        port = server.server_address[1]
        monkeypatch.setenv("TORCHFT_LIGHTHOUSE", f"127.0.0.1:{port}")
        assert lighthouse_address(timeout=1.0) == f"http://127.0.0.1:{port}"
        # Without a port: probed at the default one, and handed to torchft with it (it went to port 80).
        monkeypatch.setattr("lit_efficient.replicas.fault_tolerance.DEFAULT_PORT", port)
        monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://127.0.0.1")
        assert lighthouse_address(timeout=1.0) == f"http://127.0.0.1:{port}"
        assert not [w for w in recwarn if "lighthouse" in str(w.message)]
    finally:
        server.shutdown()


def test_a_service_that_is_not_a_lighthouse_is_warned_about(monkeypatch):
    """Another service on the port (a rendezvous store) accepted the connection, and the first quorum waited
    p2p_timeout (600 s) with nothing said."""
    server = _serve(b"<html>some other service</html>")
    with socket.socket() as silent:  # accepts, answers nothing (a TCPStore, say)
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        try:
            for port in (server.server_address[1], silent.getsockname()[1]):
                monkeypatch.setenv("TORCHFT_LIGHTHOUSE", f"http://127.0.0.1:{port}")
                with pytest.warns(UserWarning, match=rf"127.0.0.1:{port} .* does not look like a torchft lighthouse"):
                    lighthouse_address(timeout=0.5)
        finally:
            server.shutdown()


def test_torchfts_timeout_variable_bounds_the_process_group_too(monkeypatch):
    """torchft's Manager reads TORCHFT_TIMEOUT_SEC; the all-reduce's process group, built here, kept 60 s."""
    monkeypatch.delenv("TORCHFT_TIMEOUT_SEC", raising=False)
    assert _timeout_from_env(60.0) == 60.0
    monkeypatch.setenv("TORCHFT_TIMEOUT_SEC", "120")
    assert _timeout_from_env(60.0) == 120.0
    for bad in ("two minutes", "0", "inf"):
        monkeypatch.setenv("TORCHFT_TIMEOUT_SEC", bad)
        with pytest.raises(ValueError, match=rf"TORCHFT_TIMEOUT_SEC='{bad}' must be a positive number of seconds"):
            _timeout_from_env(60.0)


def test_without_torchft_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchft", None)  # what an environment without it imports
    with pytest.raises(ImportError, match=r"pip install 'lit-efficient\[fault-tolerance\]'"):
        require_torchft()


def test_one_device_is_refused_before_anything_trains():
    strategy = PACIStrategy(pipeline_stages=2, fault_tolerance="torchft", local_sgd_steps=4, replica_group_id=0)
    trainer = gpt_trainer(strategy, 1, 2)
    with pytest.raises(ValueError, match="runs each replica group on processes"):
        trainer.fit(gpt_model(), datamodule=text_data())


def _group(layout, **sync) -> SimpleNamespace:
    """A replica group's strategy as `heal` reads it: its layout and its outer sync's settings (``sync``: those
    that differ, and other attributes)."""
    settings = sync_settings(PACIStrategy(local_sgd_steps=4, outer_optimizer="nesterov")) | sync
    return SimpleNamespace(replica_group_id=1, layout=lambda: layout, **settings)


def test_healing_from_a_group_with_another_pipeline_names_both():
    strategy = _group({"num_stages": 2, "sizes": [3, 3]})
    theirs = {"pipeline": {"layout": {"num_stages": 2, "sizes": [2, 4]}}}
    with pytest.raises(ValueError, match=r"theirs .*\[2, 4\].* this group's .*\[3, 3\]"):
        heal(strategy, None, theirs, Joining())  # type: ignore[arg-type]


def test_a_group_that_trained_apart_is_ended_to_rejoin_by_a_restart():
    layout = {"num_stages": 2, "sizes": [3, 3]}
    strategy = _group(layout)
    trainer = SimpleNamespace(global_step=30, _checkpoint_connector=None)
    theirs = {"pipeline": {"layout": layout}, "global_step": 36}
    with pytest.raises(RuntimeError, match="at step 30 and the live groups at step 36.*--join_timeout_ms"):
        heal(strategy, trainer, theirs, Joining())  # type: ignore[arg-type]


def test_healing_from_a_group_that_syncs_otherwise_names_the_settings():
    """Groups launched with other local_sgd_steps paired one group's sync at step 2 with another's at step 4 and
    ended apart (1e-3), silently; another outer optimizer would average pseudo-gradients with weights."""
    layout = {"num_stages": 2, "sizes": [3, 3]}
    theirs = {"pipeline": {"layout": layout}, "global_step": 0, "torchft_sync": sync_settings(_group(layout))}
    for differs, said in (
        ({"local_sgd_steps": 2}, "local_sgd_steps: theirs 4, this group's 2"),
        ({"outer_optimizer": "average"}, "outer_optimizer: theirs 'nesterov', this group's 'average'"),
    ):
        with pytest.raises(ValueError, match=rf"cannot heal from a live group that syncs otherwise \({said}\)"):
            heal(_group(layout, **differs), None, theirs, Joining())  # type: ignore[arg-type]


def test_streaming_refuses_tied_weights_over_replicas():
    """Streaming syncs average the first stage's copy of a tied weight at one step and the last stage's at another:
    each replica's two copies would differ by its drift from the mean, for good. Refused with the fix named;
    without replicas, or without streaming (every stage syncs at the same step), nothing is refused."""
    from lit_efficient.strategy.config import check_streaming_ties

    with pytest.raises(ValueError, match="streaming_sync=True does not support tied weights.*streaming_sync=False"):
        check_streaming_ties(True, True, tied=True)  # replicas in the job, or torchft's replica groups
    for streaming, replicated, tied in [(False, True, True), (True, False, True), (True, True, False)]:
        check_streaming_ties(streaming, replicated, tied)


def test_joining_syncs_at_its_step_only_when_it_healed_from_a_live_group():
    """The first quorum after Lightning's restore. A whole job restarted from a checkpoint taken at a sync step
    holds the synced weights already (OuterSync runs before the checkpoint callbacks): syncing the due stages there
    again applied DiLoCo's outer step twice (a zero pseudo-gradient, but Nesterov's momentum moves the weights). A
    group that heals from a live one joins the sync the live groups wait in, at their step."""
    from lit_efficient.strategy.fault_tolerant import join_after_restore

    class Due:  # an averager whose stage syncs at every step
        def is_sync_step(self, step: int) -> bool:
            return True

    layout = {"num_stages": 2}
    strategy = _group(layout, averagers=[Due()])
    no_op = SimpleNamespace(restore_model=lambda: None, restore_datamodule=lambda: None, restore_callbacks=lambda: None)

    def join(heal_from: dict | None) -> list:
        """Restore a checkpoint at step 8, then the first quorum (healing from ``heal_from`` if given); the stages
        the sync reduced."""
        connector = SimpleNamespace(**vars(no_op), restore_training_state=lambda: None, _loaded_checkpoint={})
        trainer = SimpleNamespace(_checkpoint_connector=connector, global_step=8)
        joining, synced = Joining(), []

        class Replicas:
            def load_state_dict(self, state: dict) -> None:
                pass

            def sync(self, due) -> None:
                if heal_from is not None:  # torchft calls the load callback inside the quorum
                    heal(strategy, trainer, heal_from, joining)
                    trainer.global_step = heal_from["global_step"]
                synced.append(list(due()))

        join_after_restore(strategy, trainer, Replicas(), joining)
        connector._loaded_checkpoint = {"torchft": {"step": 2}}  # what Lightning's restore loaded
        connector.restore_training_state()
        return synced[0]

    assert join(None) == []  # its own state, at a step whose sync the checkpoint holds
    healed = join({"pipeline": {"layout": layout}, "global_step": 12, "torchft_joining": False})
    assert len(healed) == 1 and isinstance(healed[0], Due)  # the live groups' sync, at their step
    # healed from a peer that is joining too (a whole job restarted from two checkpoints): it syncs nothing there
    assert join({"pipeline": {"layout": layout}, "global_step": 12, "torchft_joining": True}) == []


class _Quorum:
    """A torchft Manager's all-reduce over live groups whose member vectors are given (the mean, as torchft's)."""

    def __init__(self, others: list[tuple[int, int]]) -> None:
        self.others = others  # (group index, groups launched) of the other live groups

    def allreduce(self, flat):
        total = flat.clone()
        for group, groups in self.others:
            theirs = torch.zeros_like(flat)
            if group < flat.numel() - 2:  # an index beyond the counted ones contributes no count
                theirs[group] = 1.0
            theirs[-2:] = torch.tensor([groups, groups**2], dtype=flat.dtype)
            total += theirs
        flat.copy_(total / (len(self.others) + 1))
        return SimpleNamespace(wait=lambda: None)

    def errored(self):
        return None


def _members(group: int, groups: int, others: list[tuple[int, int]], joined: bool = False) -> None:
    replicas = object.__new__(TorchftReplicas)
    replicas.group_id, replicas.groups, replicas.device = group, groups, torch.device("cpu")
    replicas.manager, replicas.participants, replicas._joined = _Quorum(others), len(others) + 1, joined
    replicas._check_members()


def test_a_group_index_live_twice_or_another_group_count_is_refused():
    """Two launches given one REPLICA_GROUP_ID both trained on its shard, the other shard never read, and so did
    groups launched with different NUM_REPLICA_GROUPS (torchft makes every launch's replica id unique): each sync's
    meeting counts the indices and the group counts of the quorum (a review of the fault-tolerant replicas)."""
    _members(0, 3, [(1, 3), (2, 3)])  # distinct indices, one count: fine
    _members(2000, 3000, [(2001, 3000)])  # beyond the indexed range: not counted, never refused by a collision
    with pytest.raises(ValueError, match=r"replica group 0 is live 2 times in the torchft quorum: another launch was "
                       r"given the same REPLICA_GROUP_ID .* both read shard 0 .* its own index, 0\.\.2"):  # fmt: skip
        _members(0, 3, [(0, 3), (1, 3)])
    _members(1, 3, [(0, 3), (0, 3)])  # the groups that share an index are refused; this one is not
    with pytest.raises(ValueError, match=r"different numbers of groups \(NUM_REPLICA_GROUPS, replica_groups\): this "
                       r"group's 2, the 2 live groups' mean 2\.5\. "):  # fmt: skip
        _members(0, 2, [(1, 3)])
    # Exact: one group of 100 launched as 101 (a relative tolerance let it pass, the diff review).
    with pytest.raises(ValueError, match="different numbers of groups"):
        _members(0, 100, [(g, 100) for g in range(1, 99)] + [(99, 101)])
    # A group that synced before only warns, and trains on: the newcomer, at its first sync, is the one refused.
    said = r"replica group 0: a group that joins the quorum is refused and stops \(replica group 0 is live 2 times "
    with pytest.warns(UserWarning, match=said + r".*\); this group, which synced before it, trains on"):
        _members(0, 3, [(0, 3), (1, 3)], joined=True)


def test_a_newcomer_whose_first_check_failed_is_still_refused_at_its_next_sync():
    """A first sync whose all-reduce failed (a peer died, a reconfiguration timed out) checked nothing, but marked
    the rank as joined, so the newcomer with a duplicated index took the warning path at its next sync and trained
    on (the second review)."""

    class Flaky(_Quorum):
        def __init__(self, others):
            super().__init__(others)
            self.failed = True  # the first all-reduce fails

        def start_quorum(self):
            pass

        def num_participants(self):
            return len(self.others) + 1

        def errored(self):
            return "a peer died" if self.failed else None

        def should_commit(self):
            failed, self.failed = self.failed, False
            return not failed

    replicas = object.__new__(TorchftReplicas)
    replicas.group_id, replicas.groups, replicas.device = 0, 2, torch.device("cpu")
    replicas.manager, replicas._joined = Flaky([(0, 2)]), False
    assert replicas.sync(lambda: []) is False  # not committed, nothing judged
    with pytest.raises(ValueError, match="replica group 0 is live 2 times"):
        replicas.sync(lambda: [])
