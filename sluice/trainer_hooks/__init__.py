"""trainer_hooks"""
