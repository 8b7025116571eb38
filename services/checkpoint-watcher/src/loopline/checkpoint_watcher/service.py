"""The checkpoint-watcher process: connect, answer svc.checkpoint_watcher.status, and turn each
finished checkpoint in the job directories into an adapter object plus a CHECKPOINTS announcement.

Loops, each its own task under the shared runtime (loopline.common.runtime.service):
  scan     jobs inotify reported, and every job at each rescan -> announced  (scan_loop.py)
  inotify  changes under the jobs directory -> jobs to scan                  (watch.py)

Its only state is the cursor in KV (cursor.py): it can be stopped at any moment, and on start it
rescans every job, so checkpoints written while it was down are announced and nothing already
announced is announced again. Run one replica: two would race on the same cursors.
"""

from __future__ import annotations

import logging
from typing import Any

from loopline.checkpoint_watcher.cursor import Cursors
from loopline.checkpoint_watcher.scan_loop import ScanLoop
from loopline.checkpoint_watcher.watch import watch_jobs
from loopline.checkpoint_watcher.watcher import CheckpointWatcher
from loopline.common.config.settings import CheckpointWatcherSettings
from loopline.common.contracts import subjects
from loopline.common.runtime.service import Runtime

log = logging.getLogger(__name__)


async def run(rt: Runtime, settings: CheckpointWatcherSettings) -> None:
    # 1. The jobs directory exists before inotify watches it.
    jobs_dir = settings.jobs_dir.resolve()
    jobs_dir.mkdir(parents=True, exist_ok=True)

    # 2. Connect, and build the parts: the adapters store, the cursors, the scan loop.
    _nc, js = await rt.connect()
    obs = await js.object_store(subjects.ADAPTERS_BUCKET)
    watcher = CheckpointWatcher(jobs_dir, settings.max_adapter_bytes, js, obs, await Cursors.open(js))
    scanning = ScanLoop(watcher, jobs_dir, settings.rescan_interval_s)

    def status() -> dict[str, Any]:
        return {"jobs_dir": str(jobs_dir), "inotify": settings.inotify,
                "rescan_interval_s": settings.rescan_interval_s, "jobs": len(watcher.cursors),
                **watcher.counts, "last_announced": watcher.last_announced, "scans": scanning.scans}

    # 3. Answer svc.checkpoint_watcher.status.
    await rt.add_service(subjects.CHECKPOINT_WATCHER_SERVICE, subjects.SVC_CHECKPOINT_WATCHER_STATUS,
                         status=status, metadata={"jobs_dir": str(jobs_dir)},
                         description="Loopline checkpoint-watcher: job checkpoints -> adapters store")
    log.info("checkpoint-watcher: jobs in %s, inotify %s, rescan every %.2f s", jobs_dir,
             "on" if settings.inotify else "off", settings.rescan_interval_s)

    # 4. Scan until told to stop; inotify only makes the scan sooner, the rescans alone are complete.
    loops = {"scan": scanning.run(rt.stopping)}
    if settings.inotify:
        loops["inotify"] = watch_jobs(jobs_dir, scanning.changed, rt.stopping)
    await rt.serve(loops)
