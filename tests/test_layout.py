"""Layout: rank counts, roles, inference and its errors, printing, and real MPI splits."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from nbdist.layout import Communicators, Layout, LayoutError, Role

MW = "master-worker"
AR = "allreduce"


# -- rank counts -----------------------------------------------------------------------

COUNTS = list(itertools.product((1, 2, 3), (1, 2), (1, 2), (1, 3), (1, 2), (False, True)))


@pytest.mark.parametrize("workers,masters,procs,groups,folds,coordinator", COUNTS)
def test_master_worker_rank_count_matches_formula(workers, masters, procs, groups, folds, coordinator):
    layout = Layout(
        workers=workers, masters=masters, procs_per_worker=procs, groups=groups, folds=folds, coordinator=coordinator
    )
    expected = int(coordinator) + groups * folds * (masters + masters * workers * procs)
    assert layout.n_ranks == expected
    assert len(layout.roles) == expected
    assert [r.rank for r in layout.roles] == list(range(expected))
    kinds = [r.kind for r in layout.roles]
    assert kinds.count("coordinator") == int(coordinator)
    assert kinds.count("master") == groups * folds * masters
    assert kinds.count("worker") == groups * folds * masters * workers * procs


@pytest.mark.parametrize("workers,masters,procs,groups,folds,coordinator", COUNTS)
def test_allreduce_rank_count_matches_formula(workers, masters, procs, groups, folds, coordinator):
    layout = Layout(
        workers=workers,
        masters=masters,
        procs_per_worker=procs,
        groups=groups,
        folds=folds,
        coordinator=coordinator,
        topology=AR,
    )
    assert layout.masters == 0  # ignored whatever was passed
    assert layout.n_ranks == int(coordinator) + groups * folds * workers * procs
    assert all(r.kind in ("coordinator", "worker") for r in layout.roles)
    assert all(r.master is None for r in layout.roles)


def test_defaults_are_one_master_one_worker():
    layout = Layout()
    assert (
        layout.topology,
        layout.workers,
        layout.masters,
        layout.procs_per_worker,
        layout.groups,
        layout.folds,
        layout.coordinator,
    ) == (MW, 1, 1, 1, 1, 1, False)
    assert layout.n_ranks == 2


def test_layout_is_immutable_and_comparable():
    a, b = Layout(workers=3), Layout(workers=3)
    assert a == b and hash(a) == hash(b) and a != Layout(workers=4)
    with pytest.raises(AttributeError):
        a.workers = 5  # type: ignore[misc]


# -- roles -----------------------------------------------------------------------------


def test_roles_two_masters_two_workers_two_procs():
    layout = Layout(workers=2, masters=2, procs_per_worker=2)
    R = Role
    assert layout.roles == (
        R(0, "master", 0, 0, 0, None, None),
        R(1, "worker", 0, 0, 0, 0, 0),
        R(2, "worker", 0, 0, 0, 0, 1),
        R(3, "worker", 0, 0, 0, 1, 0),
        R(4, "worker", 0, 0, 0, 1, 1),
        R(5, "master", 0, 0, 1, None, None),
        R(6, "worker", 0, 0, 1, 0, 0),
        R(7, "worker", 0, 0, 1, 0, 1),
        R(8, "worker", 0, 0, 1, 1, 0),
        R(9, "worker", 0, 0, 1, 1, 1),
    )
    assert [r.rank for r in layout.roles if r.is_top_master] == [0]
    assert [r.rank for r in layout.roles if r.is_sub_master] == [5]
    assert [r.rank for r in layout.roles if r.is_leader] == [1, 3, 6, 8]
    assert layout.role(7) == layout.roles[7]
    assert layout.fold_ranks(0, 0) == list(range(10))


def test_roles_allreduce_two_groups_two_folds():
    layout = Layout(workers=2, groups=2, folds=2, topology=AR)
    got = [(r.rank, r.kind, r.group, r.fold, r.master, r.worker, r.proc) for r in layout.roles]
    assert got == [
        (0, "worker", 0, 0, None, 0, 0),
        (1, "worker", 0, 0, None, 1, 0),
        (2, "worker", 0, 1, None, 0, 0),
        (3, "worker", 0, 1, None, 1, 0),
        (4, "worker", 1, 0, None, 0, 0),
        (5, "worker", 1, 0, None, 1, 0),
        (6, "worker", 1, 1, None, 0, 0),
        (7, "worker", 1, 1, None, 1, 0),
    ]
    assert all(r.is_leader and not r.is_top_master and not r.is_sub_master for r in layout.roles)
    assert layout.fold_ranks(1, 0) == [4, 5]
    assert layout.fold_ranks(0, 1) == [2, 3]


def test_roles_with_coordinator_and_groups():
    layout = Layout(workers=4, groups=2, coordinator=True)
    assert layout.n_ranks == 11
    assert layout.role(0) == Role(0, "coordinator", None, None, None, None, None)
    assert not (layout.role(0).is_leader or layout.role(0).is_top_master)
    assert layout.role(1) == Role(1, "master", 0, 0, 0, None, None)
    assert layout.role(1).is_top_master and not layout.role(1).is_sub_master
    assert layout.role(5) == Role(5, "worker", 0, 0, 0, 3, 0)
    assert layout.role(6) == Role(6, "master", 1, 0, 0, None, None)
    assert layout.role(10) == Role(10, "worker", 1, 0, 0, 3, 0)
    assert layout.fold_ranks(0, 0) == [1, 2, 3, 4, 5]
    assert layout.fold_ranks(1, 0) == [6, 7, 8, 9, 10]


def test_fold_ranks_partition_the_non_coordinator_ranks():
    layout = Layout(workers=2, masters=2, procs_per_worker=3, groups=3, folds=2, coordinator=True)
    seen = []
    for g, f in itertools.product(range(3), range(2)):
        ranks = layout.fold_ranks(g, f)
        assert {(layout.role(r).group, layout.role(r).fold) for r in ranks} == {(g, f)}
        seen += ranks
    assert seen == list(range(1, layout.n_ranks))


def test_out_of_range_queries_raise():
    layout = Layout(workers=2)
    with pytest.raises(LayoutError, match="rank 3 is outside this layout of 3 ranks"):
        layout.role(3)
    with pytest.raises(LayoutError):
        layout.role(-1)
    with pytest.raises(LayoutError, match="no group 0, fold 1"):
        layout.fold_ranks(0, 1)


# -- validation ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,value",
    [
        ("workers", 0),
        ("workers", -1),
        ("masters", 0),
        ("procs_per_worker", 0),
        ("groups", 0),
        ("folds", 0),
        ("workers", 1.5),
        ("workers", "2"),
        ("workers", True),
    ],
)
def test_bad_counts_are_rejected_with_the_option_name(name, value):
    with pytest.raises(LayoutError) as info:
        Layout(**{name: value})
    flag = "--" + name.replace("_", "-")
    assert name in str(info.value) and flag in str(info.value)
    assert isinstance(info.value, ValueError)


def test_masters_is_ignored_in_allreduce():
    assert Layout(topology=AR, masters=0).masters == 0
    assert Layout(topology=AR, masters=5, workers=3).n_ranks == 3


def test_unknown_topology():
    with pytest.raises(LayoutError, match="unknown topology 'ring'.*master-worker.*allreduce"):
        Layout(topology="ring")


def test_coordinator_must_be_bool():
    with pytest.raises(LayoutError, match="coordinator"):
        Layout(coordinator=1)  # type: ignore[arg-type]


# -- for_world -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "size,options,workers",
    [
        (2, {}, 1),
        (6, {}, 5),
        (4, {"masters": 2}, 1),
        (6, {"masters": 2}, 2),
        (10, {"masters": 2, "procs_per_worker": 2}, 2),
        (11, {"groups": 2, "coordinator": True}, 4),
        (5, {"topology": AR, "coordinator": True, "procs_per_worker": 2}, 2),
        (8, {"topology": AR, "groups": 2, "folds": 2}, 2),
        (1, {"topology": AR}, 1),
        (25, {"masters": 2, "groups": 2, "folds": 2, "coordinator": True}, 2),
    ],
)
def test_for_world_infers_workers(size, options, workers):
    layout = Layout.for_world(size, **options)
    assert layout.workers == workers
    assert layout.n_ranks == size
    assert layout == Layout(workers=workers, **options)


@pytest.mark.parametrize(
    "size,options,formula,valid,fixes",
    [
        (5, {"masters": 2}, "2 + 2 x W", "(4, 6, 8, ...)", "-n 4 (W = 1) or -n 6 (W = 2)"),
        (1, {}, "1 + W", "(2, 3, 4, ...)", "-n 2 (W = 1)"),
        (1, {"coordinator": True}, "2 + W", "(3, 4, 5, ...)", "-n 3 (W = 1)"),  # a study on 1 process
        (
            3,
            {"masters": 2, "procs_per_worker": 2, "coordinator": True},
            "3 + 4 x W",
            "(7, 11, 15, ...)",
            "-n 7 (W = 1)",
        ),
        (7, {"topology": AR, "procs_per_worker": 2}, "2 x W", "(2, 4, 6, ...)", "-n 6 (W = 3) or -n 8 (W = 4)"),
        (20, {"groups": 2, "folds": 3}, "6 + 6 x W", "(12, 18, 24, ...)", "-n 18 (W = 2) or -n 24 (W = 3)"),
        (
            6,
            {"topology": AR, "groups": 2, "coordinator": True},
            "1 + 2 x W",
            "(3, 5, 7, ...)",
            "-n 5 (W = 2) or -n 7 (W = 3)",
        ),
    ],
)
def test_for_world_error_states_the_valid_sizes(size, options, formula, valid, fixes):
    with pytest.raises(LayoutError) as info:
        Layout.for_world(size, **options)
    msg = str(info.value)
    assert msg.startswith(f"{size} rank")
    assert f"needs {formula} ranks" in msg
    assert valid in msg
    assert f"start {fixes}," in msg
    # Every size the message offers really is a valid size.
    for offered in (int(x) for x in valid.strip("(.)").replace(" ", "").split(",") if x):
        assert Layout.for_world(offered, **options).n_ranks == offered


def test_for_world_error_describes_the_layout_asked_for():
    with pytest.raises(LayoutError) as info:
        Layout.for_world(5, masters=2)
    assert "5 ranks cannot be laid out as 2 masters x (1 + W workers)" in str(info.value)
    with pytest.raises(LayoutError) as info:
        Layout.for_world(4, coordinator=True, groups=2, procs_per_worker=3)
    assert ("cannot be laid out as 1 coordinator + 2 groups x 1 fold x (1 master + W workers of 3 processes)") in str(
        info.value
    )


def test_for_world_with_workers_given_checks_the_size():
    assert Layout.for_world(6, workers=5).n_ranks == 6
    with pytest.raises(LayoutError) as info:
        Layout.for_world(4, workers=5)
    assert str(info.value) == (
        "this layout needs 6 ranks (1 master + 5 workers), but 4 were started: "
        "start 6 ranks (-n 6), or use --workers 3 to fit 4 ranks"
    )
    with pytest.raises(LayoutError) as info:
        Layout.for_world(6, workers=2, masters=2, coordinator=True)
    # 6 ranks fit no worker count here (3 + 2 x W), so no --workers value is suggested.
    assert str(info.value) == (
        "this layout needs 7 ranks (1 coordinator + 2 masters x (1 + 2 workers)), but 6 were "
        "started: start 7 ranks (-n 7), or change --workers"
    )
    with pytest.raises(LayoutError, match=r"but 1 was started: start 6 ranks \(-n 6\)"):
        Layout.for_world(1, workers=5)


@pytest.mark.parametrize("size", [0, -3, 2.0, True])
def test_for_world_rejects_bad_sizes(size):
    with pytest.raises(LayoutError, match="number of MPI ranks"):
        Layout.for_world(size)


def test_for_world_validates_other_options_first():
    with pytest.raises(LayoutError, match="--masters"):
        Layout.for_world(4, masters=0)
    with pytest.raises(LayoutError, match="unknown topology"):
        Layout.for_world(4, topology="tree")


# -- printing --------------------------------------------------------------------------


def test_describe():
    assert Layout(workers=4, groups=2, coordinator=True).describe() == (
        "11 ranks: 1 coordinator + 2 groups x 1 fold x (1 master + 4 workers)"
    )
    assert Layout(workers=5).describe() == "6 ranks: 1 master + 5 workers"
    assert Layout(workers=1).describe() == "2 ranks: 1 master + 1 worker"
    assert Layout(workers=2, masters=2).describe() == "6 ranks: 2 masters x (1 + 2 workers)"
    assert Layout(workers=2, masters=2, procs_per_worker=2, folds=3).describe() == (
        "30 ranks: 1 group x 3 folds x 2 masters x (1 + 2 workers of 2 processes)"
    )
    assert Layout(workers=1, topology=AR).describe() == "1 rank: 1 worker"
    assert Layout(workers=2, procs_per_worker=2, topology=AR, coordinator=True).describe() == (
        "5 ranks: 1 coordinator + 2 workers of 2 processes"
    )


def test_tree_master_worker_two_masters():
    assert Layout(workers=2, masters=2).tree() == "\n".join(
        [
            "master-worker layout, 6 ranks: 2 masters x (1 + 2 workers)",
            "fold 0 (group 0)  ranks 0-5",
            "├── master 0 [top master]  rank 0",
            "│   ├── worker 0  rank 1",
            "│   └── worker 1  rank 2",
            "└── master 1 [sub-master]  rank 3",
            "    ├── worker 0  rank 4",
            "    └── worker 1  rank 5",
        ]
    )


def test_tree_multi_process_workers_show_rank_ranges():
    lines = Layout(workers=2, procs_per_worker=2).tree().splitlines()
    assert lines[2] == "└── master 0  rank 0"
    assert lines[3:] == ["    ├── worker 0  ranks 1-2", "    └── worker 1  ranks 3-4"]


def test_tree_allreduce_with_coordinator_groups_and_folds():
    lines = Layout(workers=2, groups=2, folds=2, topology=AR, coordinator=True).tree().splitlines()
    assert lines[0] == "allreduce layout, 9 ranks: 1 coordinator + 2 groups x 2 folds x 2 workers"
    assert lines[1] == "coordinator  rank 0"
    assert lines[2:9] == [
        "group 0  ranks 1-4",
        "├── fold 0  ranks 1-2",
        "│   ├── worker 0  rank 1",
        "│   └── worker 1  rank 2",
        "└── fold 1  ranks 3-4",
        "    ├── worker 0  rank 3",
        "    └── worker 1  rank 4",
    ]
    assert "group 1  ranks 5-8" in lines
    assert "    └── worker 1  rank 8" == lines[-1]
    assert not any("master" in line for line in lines)


def test_tree_collapses_single_fold_into_group_line():
    lines = Layout(workers=1, groups=2, coordinator=True).tree().splitlines()
    assert lines[1:] == [
        "coordinator  rank 0",
        "group 0 (fold 0)  ranks 1-2",
        "└── master 0  rank 1",
        "    └── worker 0  rank 2",
        "group 1 (fold 0)  ranks 3-4",
        "└── master 0  rank 3",
        "    └── worker 0  rank 4",
    ]


def test_tree_lists_every_rank_once():
    layout = Layout(workers=3, masters=2, groups=2, folds=2)
    text = layout.tree()
    for rank in range(layout.n_ranks):
        assert text.count(f"  rank {rank}\n") + text.endswith(f"  rank {rank}") == 1


def test_to_dict_round_trips_through_json():
    layout = Layout(workers=2, masters=2, procs_per_worker=2, groups=2, folds=1, coordinator=True)
    data = layout.to_dict()
    assert json.loads(json.dumps(data)) == data
    assert Layout.from_dict(json.loads(json.dumps(data))) == layout
    assert data["n_ranks"] == 21 and data["describe"] == layout.describe()
    assert data["options"] == {
        "topology": MW,
        "workers": 2,
        "masters": 2,
        "procs_per_worker": 2,
        "groups": 2,
        "folds": 1,
        "coordinator": True,
    }
    coord, group0, group1 = data["nodes"]
    assert coord == {"kind": "coordinator", "rank": 0, "ranks": [0], "children": []}
    assert group1["kind"] == "group" and group1["index"] == 1 and group1["ranks"] == list(range(11, 21))
    (fold,) = group0["children"]
    assert fold["kind"] == "fold" and fold["ranks"] == list(range(1, 11))
    top, sub = fold["children"]
    assert (top["kind"], top["top"], top["rank"], sub["top"], sub["rank"]) == ("master", True, 1, False, 6)
    assert top["children"][1] == {"kind": "worker", "index": 1, "rank": 4, "ranks": [4, 5], "children": []}


def test_to_dict_nodes_cover_roles():
    layout = Layout(workers=3, procs_per_worker=2, groups=2, folds=2, topology=AR)

    def leaves(node):
        return [node] if not node["children"] else [x for c in node["children"] for x in leaves(c)]

    workers = [w for n in layout.to_dict()["nodes"] for w in leaves(n)]
    assert [r for w in workers for r in w["ranks"]] == list(range(layout.n_ranks))
    for w in workers:
        assert all(layout.role(r).worker == w["index"] for r in w["ranks"])
        assert layout.role(w["rank"]).is_leader


def test_module_imports_without_mpi():
    import nbdist.layout as mod

    assert mod.__all__ == ["Layout", "Role", "LayoutError", "Communicators"]
    assert Communicators.__slots__
    # Building and printing layouts must not pull in MPI or torch.
    code = (
        "import sys; from nbdist.layout import Layout; Layout(workers=3).tree(); "
        "assert 'mpi4py' not in sys.modules and 'torch' not in sys.modules"
    )
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


# -- real MPI --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "n,options",
    [
        (6, {"workers": 2, "masters": 2}),
        (6, {"workers": 1, "masters": 2, "procs_per_worker": 2}),
        (5, {"workers": 2, "procs_per_worker": 2, "topology": AR, "coordinator": True}),
        (7, {"workers": 2, "groups": 2, "coordinator": True}),
    ],
)
def test_split_under_mpiexec(mpirun, n, options):
    result = mpirun(n, ["tests/mpi_scripts/layout_split.py", json.dumps(options)], timeout=60)
    assert result.returncode == 0, result.output
    ok = sorted(int(line.split()[2]) for line in result.stdout.splitlines() if line.startswith("OK rank "))
    assert ok == list(range(n)), result.output
    layout = Layout(**options)
    for role in layout.roles:
        assert f"OK rank {role.rank} {role.kind}" in result.stdout
