"""python -m workers --connect ENDPOINT --rank R ...: one worker process."""

import sys

from workers.binding import bind_from_env

bind_from_env()  # first: before anything starts a thread

from workers.main import main  # noqa: E402

sys.exit(main())
