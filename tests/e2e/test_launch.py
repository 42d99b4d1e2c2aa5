"""The launchers start a multi-node job as a cluster would: 2 "nodes" x 1 process on loopback.

``launch/run.sh`` with a c10d rendezvous (``NNODES``/``RDZV_ENDPOINT``), and
``launch/slurm.sbatch`` under stand-ins for ``srun``/``scontrol`` that start its per-node
command once per node on this machine, as SLURM would on each node. Both run the quick start
with its YAML and must print the numbers plain ``python`` prints, and leave a log file per rank.

SLURM itself is not installable here (no ``sbatch`` on PyPI: ``pyslurm`` needs a cluster's
``libslurm``), so ``slurm.sbatch``'s ``#SBATCH`` lines are read as ``sbatch`` reads them
(``src/sbatch/opt.c``: directives until the first line that is neither blank nor a comment;
each line's words as options, ``--name=value``, ``--name value`` or ``-X value``, against
sbatch's own option names), its output file must be one SLURM can open before the script
runs, and the ``srun`` it issues must hand each node's torchrun the node's CPUs.
"""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.test_torchrun import EXAMPLE, ROOT, _numbers, _run

YAML = str(ROOT / "examples" / "quickstart.yaml")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GT_DEVICE": "cpu", "GT_CONFIG": YAML}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"  # torchrun
    return {**env, **extra}


def _strip(out: str) -> str:
    """torchrun's ``--tee`` prefixes each line with its rank (``[default0]:``)."""
    return "\n".join(ln.split("]:", 1)[-1] for ln in out.splitlines())


def _same_numbers(out: str, ref: list[float]) -> None:
    got = _numbers(out)
    assert len(got) == len(ref) >= 8, out
    for g, r in zip(got, ref):
        assert abs(g - r) <= 1e-5 * max(1.0, abs(r)), (g, r, out)


@pytest.mark.slow
def test_run_sh_two_nodes_with_c10d_rendezvous(tmp_path):
    ref = _numbers(_run([sys.executable, str(EXAMPLE)]))
    endpoint = f"127.0.0.1:{_free_port()}"
    nodes = [
        subprocess.Popen(
            [str(ROOT / "launch" / "run.sh"), "1", str(EXAMPLE)],
            env=_env(
                NNODES="2",
                RDZV_ENDPOINT=endpoint,
                RDZV_ID="loopback",
                LOG_DIR=str(tmp_path / f"node{n}"),
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for n in range(2)
    ]
    outs = []
    for p in nodes:
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0, err[-3000:]
        outs.append(_strip(out))
    printed = [o for o in outs if "world=" in o]
    assert len(printed) == 1  # rank 0 prints, on whichever node the rendezvous made node 0
    assert "world=2 x: (Shard(dim=0),)" in printed[0]
    _same_numbers(printed[0], ref)
    logs = sorted(tmp_path.rglob("stdout.log"))
    assert len(logs) == 2  # one per rank


@pytest.mark.slow
def test_slurm_sbatch_starts_one_torchrun_per_node(tmp_path):
    ref = _numbers(_run([sys.executable, str(EXAMPLE)]))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # scontrol's stand-in lists the head node first, then a long tail (a job of many nodes):
    # a script that reads only its first line closes the pipe early and dies of SIGPIPE
    (bin_dir / "scontrol").write_text(
        "#!/bin/sh\necho 127.0.0.1\nfor i in $(seq 20000); do echo 127.0.0.2; done\n"
    )
    # srun's stand-in: its per-node command, once per node, each with its SLURM_NODEID
    (bin_dir / "srun").write_text(
        "#!/usr/bin/env bash\n"
        'while [[ "$1" == --* ]]; do shift; done\n'
        'for ((n = 0; n < SLURM_JOB_NUM_NODES; n++)); do SLURM_NODEID=$n "$@" & done\n'
        "status=0; for job in $(jobs -p); do wait $job || status=$?; done; exit $status\n"
    )
    for tool in ("scontrol", "srun"):
        (bin_dir / tool).chmod(0o755)
    env = _env(
        SLURM_JOB_ID="4242",
        SLURM_JOB_NODELIST="node[1-2]",
        SLURM_JOB_NUM_NODES="2",
        SLURM_GPUS_ON_NODE="1",
        SLURM_CPUS_ON_NODE="2",
        RDZV_PORT=str(_free_port()),
    )
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    r = subprocess.run(
        ["bash", str(ROOT / "launch" / "slurm.sbatch"), str(EXAMPLE)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = _strip(r.stdout)
    assert "job 4242: 2 nodes x 1 GPUs, 2 CPUs per node, rendezvous 127.0.0.1:" in out
    _same_numbers("\n".join(ln for ln in out.splitlines() if not ln.startswith("job ")), ref)
    logs = sorted((tmp_path / "logs" / "4242").rglob("stdout.log"))
    assert len(logs) == 2 and {p.relative_to(tmp_path).parts[2] for p in logs} == {
        "node0",
        "node1",
    }


SBATCH = ROOT / "launch" / "slurm.sbatch"

# sbatch's long options (SLURM 23.11 ``man sbatch``): those that take a value ("="), may
# take one ("?"), or take none (""). getopt would also take an unambiguous prefix; a script
# should not, so prefixes are refused here.
_TAKE_A_VALUE = (
    "account acctg-freq array batch bb bbf begin chdir cluster-constraint clusters comment "
    "constraint container container-id core-spec cores-per-socket cpu-freq cpus-per-gpu "
    "cpus-per-task deadline delay-boot dependency distribution error export export-file "
    "extra extra-node-info gid gpu-bind gpu-freq gpus gpus-per-node gpus-per-socket "
    "gpus-per-task gres gres-flags hint input job-name licenses mail-type mail-user "
    "mcs-label mem mem-bind mem-per-cpu mem-per-gpu mincpus network nodefile nodelist "
    "nodes ntasks ntasks-per-core ntasks-per-gpu ntasks-per-node ntasks-per-socket "
    "open-mode output partition power prefer priority profile qos reservation signal "
    "sockets-per-node switches thread-spec threads-per-core time time-min tmp "
    "tres-per-task uid wckey wrap exclude"
)
_MAY_TAKE_ONE = "exclusive get-user-env kill-on-invalid-dep nice propagate"
_TAKE_NONE = (
    "contiguous hold ignore-pbs no-kill no-requeue overcommit oversubscribe parsable quiet "
    "reboot requeue spread-job test-only use-min-nodes verbose wait"
)
_SBATCH_LONG = {
    **dict.fromkeys(_TAKE_A_VALUE.split(), "="),
    **dict.fromkeys(_MAY_TAKE_ONE.split(), "?"),
    **dict.fromkeys(_TAKE_NONE.split(), ""),
}
_SBATCH_SHORT = {  # short option -> its long name
    "A": "account", "a": "array", "b": "begin", "B": "extra-node-info", "C": "constraint",
    "c": "cpus-per-task", "D": "chdir", "d": "dependency", "e": "error", "F": "nodefile",
    "G": "gpus", "H": "hold", "i": "input", "J": "job-name", "k": "no-kill", "L": "licenses",
    "M": "clusters", "m": "distribution", "N": "nodes", "n": "ntasks", "O": "overcommit",
    "o": "output", "p": "partition", "Q": "quiet", "q": "qos", "S": "core-spec",
    "s": "oversubscribe", "t": "time", "v": "verbose", "W": "wait", "w": "nodelist",
    "x": "exclude",
}  # fmt: skip


def _sbatch_directives(text: str) -> tuple[dict[str, str | None], list[int]]:
    """The options sbatch takes from a script's ``#SBATCH`` lines, as ``src/sbatch/opt.c``
    reads them, and the line numbers it read them from.

    sbatch reads lines from the top; a line starting ``#SBATCH`` holds options (its words up
    to a ``#`` comment); any other line whose first non-blank character is not ``#`` is a
    command, and sbatch reads no further. Each option must be sbatch's, with a value where it
    needs one; an unknown option or a missing value fails the submission."""
    opts: dict[str, str | None] = {}
    lines: list[int] = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.startswith("#SBATCH"):
            if line.strip() and not line.lstrip().startswith("#"):
                break  # the first command: sbatch stops reading directives here
            continue
        lines.append(n)
        words = shlex.split(line[len("#SBATCH") :], comments=True)
        while words:
            word = words.pop(0)
            if word.startswith("--"):
                name, eq, value = word[2:].partition("=")
                arity = _SBATCH_LONG.get(name)
                assert arity is not None, f"line {n}: sbatch: unrecognized option {word!r}"
                if arity == "=" and not eq:
                    assert words, f"line {n}: sbatch: option {word!r} requires an argument"
                    value = words.pop(0)
                assert arity or not eq, f"line {n}: sbatch: option {word!r} takes no argument"
                opts[name] = value if (eq or arity == "=") else None
            else:
                assert word.startswith("-") and word[1:2] in _SBATCH_SHORT, (
                    f"line {n}: sbatch: invalid option {word!r}"
                )
                name = _SBATCH_SHORT[word[1]]
                if _SBATCH_LONG[name] == "=":
                    value = word[2:] or (words.pop(0) if words else "")
                    assert value, f"line {n}: sbatch: option {word!r} requires an argument"
                    opts[name] = value
                else:
                    opts[name] = None
    return opts, lines


def test_slurm_sbatch_directives_read_as_sbatch_reads_them():
    text = SBATCH.read_text()
    opts, read = _sbatch_directives(text)
    every = [n for n, ln in enumerate(text.splitlines(), 1) if ln.lstrip().startswith("#SBATCH")]
    assert read == every, "an #SBATCH line below the first command: sbatch ignores it"
    assert opts["nodes"] == "2" and opts["gpus-per-node"] == "8"
    assert opts["ntasks-per-node"] == "1" and "exclusive" in opts
    # SLURM opens the job's output file before the script runs (on the first node, in the
    # directory sbatch ran in unless --chdir): its folder must exist then. A folder named by
    # the job (%j, %x, ...) cannot; the submit directory itself always does.
    for key in ("output", "error"):
        folder = os.path.dirname(opts.get(key) or "")
        assert "%" not in folder, f"--{key}={opts[key]}: SLURM does not make {folder}/"
        assert not folder or (ROOT / folder).is_dir(), f"--{key}: {folder}/ is not in the repo"


@pytest.mark.parametrize(
    ("env", "cpus"), [({"SLURM_CPUS_ON_NODE": "32"}, "32"), ({"SLURM_CPUS_PER_TASK": "12"}, "12")]
)
def test_slurm_srun_gets_the_nodes_cpus(env, cpus, tmp_path):
    # SLURM >= 22.05: srun does not inherit the job's --cpus-per-task, and a step's task
    # gets one CPU unless srun asks: torchrun and all its ranks would share it.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho node1\necho node2\n")
    (bin_dir / "srun").write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {tmp_path}/srun.args\n')
    for tool in ("scontrol", "srun"):
        (bin_dir / tool).chmod(0o755)
    slurm = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_JOB_NUM_NODES": "2"}
    base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    r = subprocess.run(
        ["bash", str(SBATCH), "train.py"],
        env={**base, **slurm, **env, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    args = (tmp_path / "srun.args").read_text().splitlines()
    srun_opts = args[: args.index("bash")]  # srun's own options, before the per-node command
    assert f"--cpus-per-task={cpus}" in srun_opts, srun_opts
    assert "--ntasks-per-node=1" in srun_opts and "--kill-on-bad-exit=1" in srun_opts
    assert f"{cpus} CPUs per node" in r.stdout
