"""The HTTP service: ``create_app(settings)``, one router per route group, auth and limits, the error
handlers that turn domain errors into the one error body, the dashboard and the OpenAPI extras."""
