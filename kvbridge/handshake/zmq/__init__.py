"""The ``zmq`` side channels, on ZMTP 3.0 spoken by hand. Modules (each imports only the
ones above it in this list):

* ``zmtp``            the framing both ends share, and the listener
* ``dealer``          the client: a DEALER connection, each reply bounded in frames and bytes
* ``kvbridge_wire``   kvbridge's messages: server and client
* ``vllm_wire``       vLLM's own messages (the plug-in's ``zmq`` method): server and client
"""
