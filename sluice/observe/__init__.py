"""Views of a run: `top` (live, from the daemons' Prometheus metrics) and `report` (after the run).

    scrape.py   read /metrics (or resolve a daemon endpoint to it) into samples and views
    top.py      `sluice top`: a refreshing terminal table (rich)
    report.py   `sluice report`: one self-contained HTML page with charts (matplotlib)
    cli.py      registers both subcommands

The Grafana dashboard and Prometheus alert rules on the same metrics live in
deploy/grafana/ and deploy/prometheus/. Nothing here imports the daemon.
"""
