"""manifest"""
