"""The code a launch sends (``sync:``): `manifest` (what is sent, its tree and code id;
local only), `push` (the sync over the agents' sessions, through the gateway tree),
`step` (where the launch calls it). The host side is `fdl_fabric.agent.codestore`."""
