"""A reward module that, when imported, starts a thread-pool job that never ends and never shuts the pool down: the
trainer imports it, so the interpreter's exit would wait for that job forever (`reward_fixtures:varied` scores)."""
import concurrent.futures, time
from reward_fixtures import varied as reward

_POOL = concurrent.futures.ThreadPoolExecutor(1)
_POOL.submit(time.sleep, 3600)
