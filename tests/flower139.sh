#!/usr/bin/env bash
# The Flower 1.39 lane: run with an environment whose Flower is 1.39 first on PATH (.ci/run
# makes one; docs/deployment.md says how to make your own). The same test files as the main
# lanes, the ones that touch what differs between Flower releases.
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "from common.flower_compat import flower_series; import sys; s = flower_series(); \
print('flower139 lane: flwr', s); sys.exit(s != '1.39')"
python -m pytest -q -p no:cacheprovider -m "not docker" \
    tests/test_flower_compat.py tests/test_docker_compose.py tests/test_node_runner.py tests/test_deploy.py \
    "tests/test_long_runs_finish.py::test_a_simulation_paused_longer_than_flowers_heartbeat_timeout_completes" \
    "tests/test_long_runs_finish.py::test_a_deployment_whose_server_side_process_is_killed_resumes" \
    "tests/test_run_command.py::test_flwr_run_dot_runs_the_default_experiment_on_flowers_default_federation"
