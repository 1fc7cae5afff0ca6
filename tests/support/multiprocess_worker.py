"""One process of a two-process JAX job on CPU (``tests/trainer/runtime/test_direct_restore.py`` starts two of these).

Usage: ``python tests/support/multiprocess_worker.py PROCESS_ID PORT ROOT``. The processes join through JAX's
distributed runtime (coordinator on 127.0.0.1:PORT; the CPU collectives bound to 127.0.0.1 as well), save
one step with ``trainer_client.runtime.saving._checkpointing.Checkpointer`` across their 8 devices (4 each), then read
it back with the direct restore onto a 4x2 mesh and check every shard they hold. Prints ``PROCESS_ID ok``.
"""

from __future__ import annotations

import os
import sys
from typing import Any

process_id, port, root = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax._src import xla_bridge  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

_gloo = xla_bridge._jax.make_gloo_tcp_collectives


def _loopback_gloo(distributed_client: Any) -> Any:
    """The CPU collectives, listening on loopback only."""
    return _gloo(distributed_client=distributed_client, hostname="127.0.0.1")


xla_bridge._jax.make_gloo_tcp_collectives = _loopback_gloo
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id,
                           coordinator_bind_address=f"127.0.0.1:{port}", initialization_timeout=60)

from trainer_client.runtime.restore._direct_restore import restore_direct  # noqa: E402
from trainer_client.runtime.saving._checkpointing import Checkpointer, leaf_name  # noqa: E402

full = {f"w{i}": np.arange(256 * 64, dtype=np.float32).reshape(256, 64) * (i + 1) for i in range(3)}
mesh = Mesh(np.array(jax.devices()).reshape(8), ("data",))
state = {k: jax.make_array_from_callback(v.shape, NamedSharding(mesh, P("data")), v.__getitem__)
         for k, v in full.items()}
ck = Checkpointer(root, async_save=False)
ck.save(1, state, data_position=0, global_batch=8, mesh=mesh, slices=[])
ck.close()

grid = Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b"))
target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(grid, P("a", "b"))) for k, v in full.items()}
restored = restore_direct(f"{root}/1/default", target, leaf_name)
for name, array in restored.items():
    assert len(array.addressable_shards) == 4
    for shard in array.addressable_shards:
        assert np.array_equal(np.asarray(shard.data), full[name][shard.index]), (name, shard.index)
print(f"{process_id} ok", flush=True)
jax.distributed.shutdown()
