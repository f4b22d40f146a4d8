"""What --store may name (no password, no bare word, no directory a typo made up), SQLite
stores on network file systems (found in mount tables), and the files nbdist creates
being their owner's alone whatever the umask. No MPI: each case is a function call."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from nbdist.durable import make_dir, open_private, private_fd, write_json
from nbdist.options import TrainOptions, saved_run_options
from nbdist.store import RunStore, StoreError, check_store, mask_url, network_store_problem, place_store
from nbdist.store.mounts import file_system, network_mount, parse_mounts
from nbdist.transport.interfaces import interface_address, launch_spans_hosts

# A login node's table, as /proc/mounts writes it (a space in a mount point is \040).
MOUNTS = """\
/dev/sda1 / ext4 rw,relatime 0 0
proc /proc proc rw,nosuid,nodev,noexec,relatime 0 0
tmpfs /tmp tmpfs rw,nosuid,nodev 0 0
fs1:/export/home /home nfs4 rw,relatime,vers=4.2,sec=sys 0 0
/dev/sdb1 /home/alice/local ext4 rw,relatime 0 0
10.0.0.5@o2ib:/scratch /scratch lustre rw,flock,lazystatfs 0 0
gpfs0 /gpfs gpfs rw,relatime 0 0
//nas/share /mnt/my\\040share cifs rw,vers=3.0 0 0
beegfs_nodev /mnt/beegfs beegfs rw,relatime 0 0
ceph-fuse /cephfs fuse.ceph-fuse rw,nosuid,nodev 0 0
/dev/sdc1 /scratch ext4 rw,relatime 0 0
"""


# ------------------------------------------------------------------ network file systems
@pytest.mark.parametrize(
    "path, kind, point",
    [
        ("/home/bob/runs/nbdist.db", "nfs4", "/home"),
        ("/home", "nfs4", "/home"),
        ("/home/alice/local/runs/nbdist.db", "ext4", "/home/alice/local"),  # the longer mount point wins
        ("/home/alice/localx/nbdist.db", "nfs4", "/home"),  # a prefix of the name is not a prefix of the path
        ("/gpfs/projects/x.db", "gpfs", "/gpfs"),
        ("/mnt/my share/runs.db", "cifs", "/mnt/my share"),
        ("/mnt/beegfs/x.db", "beegfs", "/mnt/beegfs"),
        ("/cephfs/a/b.db", "fuse.ceph-fuse", "/cephfs"),
        ("/tmp/x.db", "tmpfs", "/tmp"),
        ("/opt/x.db", "ext4", "/"),
        ("/scratch/me/x.db", "ext4", "/scratch"),  # mounted over the lustre one: the last listed
    ],
)
def test_a_paths_file_system_is_the_longest_mount_point_above_it(path, kind, point):
    mount = file_system(path, MOUNTS)
    assert (mount.kind, mount.point) == (kind, point)


def test_network_file_systems_are_told_from_local_ones():
    networked = {m.point for m in parse_mounts(MOUNTS) if m.networked}
    assert networked == {"/home", "/scratch", "/gpfs", "/mnt/my share", "/mnt/beegfs", "/cephfs"}
    assert str(network_mount("/home/bob/runs/nbdist.db", MOUNTS)) == "nfs4 at /home"
    assert network_mount("/home/alice/local/nbdist.db", MOUNTS) is None
    assert network_mount("/tmp/nbdist.db", MOUNTS) is None
    assert network_mount("/tmp/x.db", "") is None  # no table: nothing is said


def test_a_sqlite_store_on_nfs_is_refused_for_several_hosts_and_warned_about_for_one():
    with pytest.raises(StoreError) as refused:
        network_store_problem("/home/bob/runs/nbdist.db", several_hosts=True, table=MOUNTS)
    message = str(refused.value)
    assert "a SQLite file on a network file system (nfs4 at /home)" in message and "span several hosts" in message
    assert "use PostgreSQL (--store postgresql://USER@HOST/DB)" in message and "\n" not in message
    warning = network_store_problem("sqlite:////gpfs/p/nb.db", several_hosts=False, table=MOUNTS)
    assert "(gpfs at /gpfs): fine from this host alone" in warning and "PostgreSQL" in warning
    assert network_store_problem("/home/alice/local/nb.db", several_hosts=True, table=MOUNTS) is None
    assert network_store_problem("postgresql://me@db/nb", several_hosts=True, table=MOUNTS) is None


def test_the_launch_says_whether_it_spans_hosts(monkeypatch):
    for name in ("OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_STEP_NUM_NODES", "SLURM_NNODES"):
        monkeypatch.delenv(name, raising=False)
    assert not launch_spans_hosts()  # a singleton
    monkeypatch.setenv("SLURM_NNODES", "2")
    assert launch_spans_hosts()
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "4")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    assert not launch_spans_hosts()  # mpiexec put every rank here, whatever the allocation
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "8")
    assert launch_spans_hosts()


def test_an_interface_or_a_subnet_gives_this_hosts_address():
    assert interface_address("lo") == "127.0.0.1"
    assert interface_address("127.0.0.0/8") == "127.0.0.1"
    with pytest.raises(Exception, match=r"no network interface 'ib7' on this host; choose one of: .*\blo\b"):
        interface_address("ib7")
    with pytest.raises(Exception, match="no address of this host .* is in the subnet 198.51.100.0/24"):
        interface_address("198.51.100.0/24")


# ------------------------------------------------------------------ what --store may be
@pytest.mark.parametrize(
    "url",
    [
        "postgresql://me:hunter2@db:5432/nbdist",
        "postgres://me:hunter2@db/nbdist",
        "postgresql://me@db/nbdist?sslmode=require&password=hunter2",
    ],
)
def test_a_store_url_with_a_password_is_refused_with_where_to_put_it(url):
    for refuse in (lambda: check_store(url), lambda: TrainOptions(store=url).validate()):
        with pytest.raises(StoreError) as caught:
            refuse()
        message = str(caught.value)
        assert "hunter2" not in message and "***" in message and "holds a password" in message
        assert "PGPASSWORD, ~/.pgpass (chmod 600) or a service file" in message and "\n" not in message


def test_a_url_of_another_database_is_refused_before_its_password():
    """mysql://me:pw@db/x is no run store whatever its password: say that, not 'use PGPASSWORD'."""
    for refuse in (
        lambda: check_store("mysql://me:hunter2@db/nb"),
        lambda: TrainOptions(store="mysql://me@db/nb").validate(),
    ):
        with pytest.raises(StoreError) as caught:
            refuse()
        message = str(caught.value)
        assert "unknown scheme 'mysql'" in message and "postgresql://" in message and "hunter2" not in message
        assert "holds a password" not in message


@pytest.mark.parametrize(
    "word, hint", [("of", " (did you mean 'off'?)"), ("offf", " (did you mean 'off'?)"), ("nb", "")]
)
def test_a_bare_word_is_no_store(word, hint):
    with pytest.raises(StoreError) as caught:
        TrainOptions(store=word).validate()
    assert str(caught.value) == (
        f"--store {word!r} is not a run store: give 'off' (record nothing), a SQLite file (a name ending "
        f"in .db or .sqlite, or a path with a directory such as ./NAME), sqlite:///PATH or "
        f"postgresql://USER@HOST:PORT/DATABASE{hint}"
    )


@pytest.mark.parametrize(
    "store", [None, "off", "OFF", "none", "", "nb.db", "x.sqlite3", "./of", "runs/nb", "~/nb", "postgresql://me@db/nb"]
)
def test_the_forms_of_a_store_pass(store):
    check_store(store)
    TrainOptions(store=store).validate()


def test_a_store_in_a_directory_that_does_not_exist_is_not_created(tmp_path):
    missing = tmp_path / "nonexistent" / "dir" / "nb.db"
    for make in (
        lambda: place_store(str(missing), str(tmp_path / "runs"), several_hosts=False),
        lambda: RunStore(missing),
    ):
        with pytest.raises(StoreError) as caught:
            make()
        assert str(caught.value).startswith(f"--store {missing}: the directory {missing.parent} does not exist;")
    assert not (tmp_path / "nonexistent").exists()
    # The default store's directory is the runs directory, which a run makes (its owner's).
    os.umask(old := os.umask(0o022))
    try:
        assert place_store(None, str(tmp_path / "runs"), several_hosts=False) == str(tmp_path / "runs" / "nbdist.db")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "runs").stat().st_mode) == 0o700


def test_a_resumed_run_of_an_older_version_connects_without_the_masked_password(tmp_path):
    (tmp_path / "options.json").write_text(
        json.dumps({**TrainOptions().to_dict(), "store": "postgresql://me:***@db/nb?sslmode=require"})
    )
    assert saved_run_options(tmp_path).store == "postgresql://me@db/nb?sslmode=require"
    assert mask_url("postgresql://me:pw@db/nb?password=x&a=b", None) == "postgresql://me@db/nb?a=b"


# ------------------------------------------------------------------ the owner's alone
def _modes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): stat.S_IMODE(p.stat().st_mode) for p in [root, *root.rglob("*")]}


@pytest.mark.parametrize("umask", [0o022, 0o000, 0o277])
def test_what_nbdist_creates_is_private_whatever_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        make_dir(tmp_path / "a" / "b")
        with open_private(tmp_path / "a" / "b" / "log.jsonl", "a") as fh:
            fh.write("{}\n")
        write_json(tmp_path / "a" / "meta.json", {"x": 1})
        os.close(private_fd(tmp_path / "a" / "failure.json", os.O_WRONLY | os.O_CREAT | os.O_EXCL))
        with RunStore(tmp_path / "a" / "nbdist.db") as store:  # SQLite, with its -wal and -shm
            store.begin_run("r", run_dir=None, options={}, layout={})
            assert (tmp_path / "a" / "nbdist.db-wal").exists() and (tmp_path / "a" / "nbdist.db-shm").exists()
            modes = _modes(tmp_path / "a")
    finally:
        os.umask(old)
    assert len(modes) == 8, modes
    assert {name: mode for name, mode in modes.items() if mode != (0o700 if name in (".", "b") else 0o600)} == {}


def test_a_file_that_is_there_keeps_its_mode(tmp_path):
    shared = tmp_path / "shared.txt"
    shared.write_text("")
    shared.chmod(0o640)  # the user's choice, for a group
    with open_private(shared, "a") as fh:
        fh.write("more\n")
    assert stat.S_IMODE(shared.stat().st_mode) == 0o640
    make_dir(tmp_path)  # exists: left as it is
    with pytest.raises(FileExistsError):
        make_dir(tmp_path, exclusive=True)


def test_libpq_variables_reach_every_rank_and_travel_by_name_only():
    from nbdist.launch import forwarded_environment, mpi_env

    env = {"PGPASSWORD": "hunter2", "PGSERVICE": "nb", "PATH": "/bin", "HOME": "/home/me"}
    assert mpi_env(env)["PGPASSWORD"] == "hunter2"  # this node's ranks inherit it
    assert forwarded_environment(env) == ["-x", "PGPASSWORD", "-x", "PGSERVICE"]  # other nodes': by name
