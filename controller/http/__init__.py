"""The controller's HTTP surface: JSON API, live status page, Prometheus metrics.

``api.create_app`` builds the app; ``server.HttpServer`` runs it in a thread of
the controller process; ``client.ApiClient`` is what the CLI talks to it with.
"""
