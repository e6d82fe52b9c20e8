"""python -m workers --connect ENDPOINT --rank R ...: one worker process."""

import sys

from workers.main import main

sys.exit(main())
