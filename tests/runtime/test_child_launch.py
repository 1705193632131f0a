"""hpcgnn.runtime's child launches (benches, the planner's calibration): this interpreter's
launcher, and a fresh world's environment (Open MPI in a GPU container: as root and without
ssh, as seen on the lent H200 machine)."""
import shutil

from hpcgnn.runtime import child as runtime


def test_a_child_world_drops_the_surrounding_jobs_variables(monkeypatch):
    monkeypatch.setenv("PMI_RANK", "3")
    monkeypatch.setenv("SLURM_STEP_ID", "7")
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "1")
    monkeypatch.setenv("HYDRA_PROXY_PORT", "9")
    monkeypatch.setenv("KEEP_ME", "yes")
    env = runtime.fresh_world_env()
    assert not any(k.startswith(("PMI_", "SLURM_", "OMPI_COMM", "HYDRA_")) for k in env)
    assert env["KEEP_ME"] == "yes"
    assert runtime.fresh_world_env({"PMI_SIZE": "2", "A": "1"}).get("A") == "1"


def test_a_child_world_keeps_the_users_mca_settings_and_drops_the_launchers(monkeypatch):
    """A site's or a container's MCA settings (transport, shared-memory workaround,
    oversubscription) reach the child job; those Open MPI's mpiexec set for its ranks (read off
    Open MPI 4.1.4's ``mpiexec -n 1 env``) do not."""
    user = {"OMPI_MCA_btl_vader_single_copy_mechanism": "none", "OMPI_MCA_pml": "ucx",
            "OMPI_MCA_rmaps_base_oversubscribe": "1", "PMIX_MCA_gds": "hash"}
    launcher = {"OMPI_MCA_orte_hnp_uri": "1.0;tcp://x", "OMPI_MCA_ess": "^singleton",
                "OMPI_MCA_ess_base_jobid": "1", "OMPI_MCA_pmix": "^s1,s2,cray,isolated",
                "OMPI_MCA_initial_wdir": "/tmp", "OMPI_MCA_mpi_oversubscribe": "0",
                "OMPI_MCA_orte_ess_num_procs": "2", "OMPI_MCA_shmem_RUNTIME_QUERY_hint": "mmap",
                "PMIX_MCA_mca_base_component_show_load_errors": "1", "PMIX_RANK": "0",
                "PMIX_NAMESPACE": "x", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_UNIVERSE_SIZE": "2"}
    env = runtime.fresh_world_env({**user, **launcher})
    assert {k: env.get(k) for k in user} == user
    assert not set(launcher) & set(env), sorted(set(launcher) & set(env))


def test_open_mpi_as_root_without_ssh_is_told_so(monkeypatch):
    monkeypatch.delenv("OMPI_MCA_plm_rsh_agent", raising=False)
    monkeypatch.setattr(runtime.os, "geteuid", lambda: 0)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    env = runtime.fresh_world_env()
    assert env["OMPI_ALLOW_RUN_AS_ROOT"] == env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] == "1"
    assert env["OMPI_MCA_plm_rsh_agent"] == "false"


def test_a_user_with_ssh_or_an_own_agent_keeps_open_mpis_defaults(monkeypatch):
    monkeypatch.setattr(runtime.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/ssh" if name == "ssh" else None)
    monkeypatch.delenv("OMPI_MCA_plm_rsh_agent", raising=False)
    env = runtime.fresh_world_env()
    assert "OMPI_ALLOW_RUN_AS_ROOT" not in env and "OMPI_MCA_plm_rsh_agent" not in env
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setenv("OMPI_MCA_plm_rsh_agent", "/opt/site/rsh")
    assert runtime.fresh_world_env()["OMPI_MCA_plm_rsh_agent"] == "/opt/site/rsh"


def test_open_mpi_binds_no_child_job_to_its_first_cores(monkeypatch):
    """Jobs started side by side must not all be bound to cores 0 and 1 (Open MPI's default for
    one or two ranks); a user's own binding policy is kept."""
    monkeypatch.delenv("OMPI_MCA_hwloc_base_binding_policy", raising=False)
    assert runtime.fresh_world_env()["OMPI_MCA_hwloc_base_binding_policy"] == "none"
    monkeypatch.setenv("OMPI_MCA_hwloc_base_binding_policy", "core")
    assert runtime.fresh_world_env()["OMPI_MCA_hwloc_base_binding_policy"] == "core"


def test_find_mpiexec_prefers_the_interpreters_own(monkeypatch, tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "python").write_text("")
    (fake / "mpiexec").write_text("")
    monkeypatch.setattr(runtime.sys, "executable", str(fake / "python"))
    assert runtime.find_mpiexec() == str(fake / "mpiexec")
