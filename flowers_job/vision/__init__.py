"""Images and networks, shared by the ranks and the served model: decode and transforms, batch decode on the device, backbones, numeric precision."""
