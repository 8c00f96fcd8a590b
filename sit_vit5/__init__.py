"""sit-vit5: SiT-family latent diffusion with SiT and ViT-5 backbones."""

__version__ = "0.1.0"
