"""What an OpenAI-compatible server and the proxy in front of it agree on, with no engine:
the request schemas and every check before tokenizing (``schemas``), the error answer and
the server-sent-event line (``responses``)."""
