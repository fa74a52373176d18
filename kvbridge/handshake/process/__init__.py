"""The side channel in a process of its own. Modules (each imports only the ones above it
in this list):

* ``control``   what the side-channel process and its parent say (a socketpair)
* ``parent``    ``SideChannelProcess``: the child started, fed, watched, restarted
* ``child``     the side-channel process: ``python -m kvbridge.handshake.process.child``
"""
