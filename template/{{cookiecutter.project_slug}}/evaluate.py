"""Evaluate a trained agent (the code is in {{ cookiecutter.package_name }}/evaluate.py):

    python evaluate.py checkpoint=runs/try                                # a run directory
    python evaluate.py checkpoint=runs/.../checkpoints/final.pt episodes=20 seed=1
    python evaluate.py checkpoint=runs/try video=true                     # mp4s in run_dir/videos
"""

import sys

from {{ cookiecutter.package_name }}.evaluate import main

if __name__ == "__main__":
    sys.exit(main())
