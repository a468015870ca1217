"""Re-render a network benchmark's Markdown from its JSON (after a change to the report's layout):
python bench/render_network.py bench/results/network/home-100.json"""

import json
import sys
from pathlib import Path

from shoal.bench import netreport

for arg in sys.argv[1:]:
    p = Path(arg)
    doc = json.loads(p.read_text())
    doc["targets"] = netreport.targets(doc["rows"])
    p.with_suffix(".md").write_text(netreport.markdown(doc))
