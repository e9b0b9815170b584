"""Views of a run: `top` (live, from the daemons' Prometheus metrics) and `report` (after the run).

    scrape.py   read /metrics (or resolve a daemon endpoint to it) into samples and views
    top.py      `sluice top`: a refreshing terminal table (rich)
    report.py   `sluice report`: reads the inputs, writes the page or the run's JSON record
    record.py   the ledger series, samples and daemon logs, read, checked and bounded
    totals.py   what each daemon counted (tokens served per source and replica, waits) across restarts
    figures.py  the run's figures (tokens served and trained, ETTR) and its JSON record
    page.py     the HTML page (escaped, no script, a Content Security Policy); charts.py its charts
    cli.py      registers both subcommands

The Grafana dashboard and Prometheus alert rules on the same metrics live in
deploy/grafana/ and deploy/prometheus/. Nothing here imports the daemon.
"""
