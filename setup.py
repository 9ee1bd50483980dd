from setuptools import find_packages, setup

setup(
    name="hvd_syncbn",
    version="0.1.0",
    description="Synchronized batch normalization for Horovod (PyTorch and TensorFlow/Keras)",
    long_description=open("README.md").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["hvd_syncbn", "hvd_syncbn.*"]),
    python_requires=">=3.9",
    install_requires=["numpy"],
    extras_require={
        "torch": ["torch>=2.4", "horovod>=0.28"],
        "tensorflow": ["tensorflow>=2.16", "horovod>=0.28"],
        "test": ["pytest", "hypothesis", "mpi4py"],
        "mpi": ["mpi4py"],
    },
)
