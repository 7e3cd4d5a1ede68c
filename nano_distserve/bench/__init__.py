"""nano_distserve's benchmark and its measurement — off the paper path.

* `python -m nano_distserve.bench` (`__main__.py`, configs/bench.yaml): `mode=sim` (`sim.py`), `mode=measured`
  (`measured.py`: real colocated and disaggregated serving beside the simulator), `mode=interference`
  (`interference.py`: step times as a long prompt joins running decodes);
* `measure.py` — the measurement the measured bench and the tests read: `measured_instance_main`, the
  instances logging every step (`StepRecord`, what `simulator.LatencyModel.fit` reads), hand-off and
  TTFT parts, and the KV transfer alone (`measure_wire`). Delete this folder and the paper path still
  serves (`disagg.instance_main`).
"""

from nano_distserve.bench.interference import run_interference
from nano_distserve.bench.measured import colocated_replica, run_measured
from nano_distserve.bench.sim import run_sim

__all__ = ["colocated_replica", "run_interference", "run_measured", "run_sim"]
